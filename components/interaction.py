"""Target-aware interaction: each candidate attends to its user's encoded history through GDPA.

Candidates of one user are a query segment and the user's history is its kv segment, so all of a
user's candidates share one history without copying it, and each candidate's output depends only on
itself, its user's history and its user's context: no candidate sees another candidate (which would
leak across targets at training time).

Legend: ``C`` candidates over the batch, ``T`` history tokens, ``B`` users, ``N`` context tokens per user.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_gem import jagged
from lightning_gem.ops import gdpa
from lightning_gem.ops.attention import ACTIVATIONS, IMPLS, PRECISIONS
from lightning_gem.ops.pointwise import IMPLS as POINTWISE_IMPLS
from lightning_gem.ops.pointwise import pairwise_dots, token_attention
from lightning_gem.ops.pointwise.tokens import MAX_TOKENS

from .encoder import NormKind, check_option, make_norm, norm_for_linear, pointwise_beside, record_attention_stats

__all__ = ["GDPAInteraction"]


class GDPAInteraction(nn.Module):
    """Candidates ``[C, dim]`` cross-attend to the encoded history ``[T, dim]``, then a residual MLP.

    ``a = out(gdpa(q(norm(cand)), k(norm(hist)), v(norm(hist))))``; ``h = cand + a``. With
    ``self_interaction=True`` a per-candidate set of feature tokens ``[h, a, context_1..N]`` (the
    candidate, what it read from the history, and ``N`` user-level tokens such as a pooled-feature token
    and a dense-feature token) goes through one small dense attention over those ``2 + N`` tokens; the
    tokens and their pairwise dot products (DLRM-style) are mixed back into ``h`` by one Linear. Finally
    ``h = h + mlp(norm(h))``. Self-interaction stays within a candidate's own tokens, so it is
    target-aware (see the module docstring).

    The key projection starts equal to the query projection (they then train apart), so scores start
    as a similarity and a candidate first attends to the history items most like itself.

    Args:
        dim: token width (candidates, history and context).
        num_heads: heads of the cross-attention (and of the token self-interaction).
        head_dim: per-head width; default ``dim // num_heads``.
        activation: GDPA activation of the cross-attention (``"softmax"`` by default; pointwise ones
            normalise by the history length).
        mlp_ratio: hidden width of the MLP as a multiple of ``dim``.
        dropout: dropout on the attention and MLP outputs.
        norm: ``"rms"`` or ``"layer"``.
        self_interaction: add the per-candidate token interaction.
        num_context_tokens: ``N``, user-level context tokens per user given to ``forward`` (only with
            ``self_interaction``).
        attention_impl: GDPA ``impl``.
        attention_precision: GDPA ``precision`` (None, or ``"fp8"``; what ``MXFP8Precision(attention=True)`` sets).
        pointwise_impl: ``impl`` of the pointwise ops (:mod:`lightning_gem.ops.pointwise`): the norms' and the token
            interaction's (fused ``token_attention`` and ``pairwise_dots`` kernels, or PyTorch's matmuls on
            ``"reference"``); None: the one beside ``attention_impl`` (``pointwise_beside``), as ``HSTULayer``'s.

    Shapes:
        candidates ``[C, dim]``, candidate_offsets ``[B + 1]``, history ``[T, dim]``, history_offsets
        ``[B + 1]``, context ``[B, N, dim]``. Output ``[C, dim]``. Users with no history get ``a = 0``;
        users with no candidates contribute nothing.

    Example:
        >>> import torch
        >>> interaction = GDPAInteraction(dim=16, num_heads=2, self_interaction=True, num_context_tokens=1)
        >>> out = interaction(torch.randn(3, 16), torch.tensor([0, 2, 3]), torch.randn(5, 16),
        ...                   torch.tensor([0, 0, 5]), context=torch.randn(2, 1, 16))
        >>> out.shape
        torch.Size([3, 16])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int = 2,
        *,
        head_dim: int | None = None,
        activation: str = "softmax",
        mlp_ratio: float = 2.0,
        dropout: float = 0.0,
        norm: NormKind = "rms",
        self_interaction: bool = False,
        num_context_tokens: int = 0,
        attention_impl: str = "auto",
        attention_precision: str | None = None,
        pointwise_impl: str | None = None,
    ) -> None:
        super().__init__()
        if dim < 1 or num_heads < 1:
            raise ValueError(f"`dim` and `num_heads` must be >= 1, got dim={dim}, num_heads={num_heads}")
        if head_dim is None and dim % num_heads:
            raise ValueError(f"`dim` ({dim}) must be divisible by `num_heads` ({num_heads}) unless `head_dim` is given")
        if num_context_tokens < 0:
            raise ValueError(f"`num_context_tokens` must be >= 0, got {num_context_tokens}")
        if num_context_tokens and not self_interaction:
            raise ValueError(
                "`num_context_tokens` needs `self_interaction=True` (context tokens feed the token interaction)"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must lie in [0, 1), got {dropout}")
        if mlp_ratio <= 0:
            raise ValueError(f"`mlp_ratio` must be > 0, got {mlp_ratio}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = head_dim if head_dim is not None else dim // num_heads
        self.activation = check_option(activation, "activation", ACTIVATIONS)
        self.attention_impl = check_option(attention_impl, "attention_impl", IMPLS)
        self.attention_precision = check_option(attention_precision, "attention_precision", PRECISIONS)
        self.pointwise_impl = check_option(pointwise_impl, "pointwise_impl", (None, *POINTWISE_IMPLS))
        self.collect_stats, self.quant_stats = False, None  # FP8 attention's counts (record_attention_stats)
        self.self_interaction = self_interaction
        self.num_context_tokens = num_context_tokens
        inner = num_heads * self.head_dim

        self.query_norm = make_norm(norm, dim)
        self.history_norm = make_norm(norm, dim)
        self.query = nn.Linear(dim, inner)
        self.key_value = nn.Linear(dim, 2 * inner)  # head-major [H, 2 * head_dim]
        self.attention_output = nn.Linear(inner, dim)
        with torch.no_grad():
            # Keys start equal to queries (then train apart): scores start as a positive semi-definite
            # similarity, so a candidate first attends to the history items most like itself.
            keys = self.key_value.weight.view(num_heads, 2, self.head_dim, dim)[:, 0]
            keys.copy_(self.query.weight.view(num_heads, self.head_dim, dim))
        if self_interaction:
            num_tokens = 2 + num_context_tokens
            # Own head count: tensor parallelism splits the cross-attention heads (`num_heads`), not these.
            self.token_num_heads = num_heads
            if dim % num_heads:
                raise ValueError(f"`dim` ({dim}) must be divisible by `num_heads` ({num_heads}) for self_interaction")
            self.token_norm = make_norm(norm, dim)
            self.token_qkv = nn.Linear(dim, 3 * dim)
            self.token_output = nn.Linear(dim, dim)
            self.mix_norm = make_norm(norm, dim)
            self.token_mix = nn.Linear(num_tokens * dim + num_tokens * (num_tokens - 1) // 2, dim)
        hidden = max(1, int(round(dim * mlp_ratio)))
        self.mlp_norm = make_norm(norm, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim))
        self.dropout = nn.Dropout(dropout)

    @staticmethod
    def norm_consumers() -> dict[str, str]:
        """Norm -> the Linear that reads its output (what FP8 conversion fuses a norm's quantization into: the
        registration order pairs the history norm with the query projection)."""
        return {"query_norm": "query", "history_norm": "key_value", "token_norm": "token_qkv", "mlp_norm": "mlp.0"}

    @staticmethod
    def tensor_parallel_plan() -> dict[str, str]:
        """Submodule name -> how a tensor-parallel plan shards that ``nn.Linear``."""
        return {
            "query": "colwise",
            "key_value": "colwise",
            "attention_output": "rowwise",
            "mlp.0": "colwise",
            "mlp.2": "rowwise",
        }

    def forward(
        self,
        candidates: Tensor,
        candidate_offsets: Tensor,
        history: Tensor,
        history_offsets: Tensor,
        *,
        context: Tensor | None = None,
        max_history_len: int | None = None,
        max_candidates: int | None = None,
        check_offsets: bool = True,
    ) -> Tensor:
        """Interact each candidate with its user's history (and context): ``[C, dim]``.

        Args:
            candidates: ``[C, dim]`` candidate tokens.
            candidate_offsets: ``[B + 1]`` offsets of each user's candidates.
            history: ``[T, dim]`` encoded history tokens.
            history_offsets: ``[B + 1]`` offsets of each user's history.
            context: ``[B, N, dim]`` user-level tokens (required iff ``num_context_tokens > 0``).
            max_history_len: an upper bound of history lengths (GDPA kernel hint).
            max_candidates: an upper bound of candidates per user (GDPA kernel hint; None: read from the
                offsets, a device sync).
            check_offsets: validate the offsets (a device sync).
        """
        for name, t in (("candidates", candidates), ("history", history)):
            jagged.check_floating(t, name)
            if t.dim() != 2 or t.shape[1] != self.dim:
                raise ValueError(f"`{name}` must be [*, {self.dim}], got shape {tuple(t.shape)}")
        num_candidates, h, d = candidates.shape[0], self.num_heads, self.head_dim
        pointwise = self.pointwise_impl or pointwise_beside(self.attention_impl)
        q_CHD = self.query(norm_for_linear(self.query_norm, candidates, pointwise)).view(num_candidates, h, d)
        kv_THD = self.key_value(norm_for_linear(self.history_norm, history, pointwise)).view(history.shape[0], h, 2 * d)
        k_THD, v_THD = kv_THD.split([d, d], dim=-1)
        if self.collect_stats and self.attention_precision == "fp8":
            record_attention_stats(self, q_CHD, k_THD, v_THD, history_offsets)
        attended = gdpa(
            q_CHD,
            k_THD,
            v_THD,
            candidate_offsets,
            history_offsets,
            activation=self.activation,
            causal=False,
            max_seq_len_q=max_candidates,
            max_seq_len_kv=max_history_len,
            impl=self.attention_impl,
            check_offsets=check_offsets,
            precision=self.attention_precision,
        )
        a = self.dropout(self.attention_output(attended.reshape(num_candidates, h * d)))
        x = candidates + a
        if self.self_interaction:
            x = x + self._token_interaction(x, a, candidate_offsets, context, pointwise)
        elif context is not None:
            raise ValueError("`context` needs `self_interaction=True` and `num_context_tokens` > 0")
        return x + self.dropout(self.mlp(norm_for_linear(self.mlp_norm, x, pointwise)))

    def _token_interaction(
        self, x: Tensor, a: Tensor, candidate_offsets: Tensor, context: Tensor | None, pointwise: str
    ) -> Tensor:
        tokens = [x, a]
        if self.num_context_tokens:
            num_users = candidate_offsets.numel() - 1
            expected = (num_users, self.num_context_tokens, self.dim)
            if context is None or tuple(context.shape) != expected:
                got = None if context is None else tuple(context.shape)
                raise ValueError(f"`context` must be [B, N, dim] = {list(expected)}, got {got}")
            user = jagged.segment_ids(candidate_offsets, x.shape[0])
            tokens.extend(context[user].unbind(1))
        elif context is not None:
            raise ValueError("`context` was given but the interaction was built with num_context_tokens=0")
        tokens_CND = torch.stack(tokens, dim=1)
        num_candidates, num_tokens = tokens_CND.shape[:2]
        h, d = self.token_num_heads, self.dim // self.token_num_heads
        # [C, N, 3 * dim], laid out as [3, H, d]; the norm written in the Linear's dtype (norm_for_linear)
        qkv_CNX = self.token_qkv(norm_for_linear(self.token_norm, tokens_CND, pointwise))
        if num_tokens > MAX_TOKENS:  # past what a kernel program holds: PyTorch's ops, whatever the impl beside
            pointwise = "reference"
        if pointwise == "reference":
            qkv = qkv_CNX.view(num_candidates, num_tokens, 3, h, d)
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [C, H, N, d]
            # A handful of tokens per candidate: two small batched matmuls, not SDPA, whose cuDNN kernel on Hopper
            # builds a new graph for every new candidate count, i.e. every batch, at a host cost far above theirs.
            weights = torch.matmul(q, k.transpose(-1, -2) * d**-0.5).softmax(dim=-1)
            mixed = torch.matmul(weights.to(v.dtype), v).transpose(1, 2).reshape(num_candidates, num_tokens, self.dim)
        else:  # the same math in one pass over qkv, read and written in the Linears' layouts (no permute copies)
            mixed = token_attention(qkv_CNX, h, d**-0.5, impl=pointwise)
        tokens_CND = self.mix_norm(tokens_CND + self.dropout(self.token_output(mixed)))
        # DLRM-style explicit pairwise dot products: a direct user x candidate signal from the first step.
        if pointwise == "reference":
            rows, cols = torch.triu_indices(num_tokens, num_tokens, offset=1, device=tokens_CND.device)
            dots = torch.einsum("cnd,cmd->cnm", tokens_CND, tokens_CND)[:, rows, cols] / self.dim**0.5
        else:  # only the upper triangle, in the same order
            dots = pairwise_dots(tokens_CND, self.dim**-0.5, impl=pointwise)
        return self.dropout(self.token_mix(torch.cat([tokens_CND.flatten(1), dots], dim=1)))
