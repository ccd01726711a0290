"""Jagged sequence encoders: the HSTU layer and a stack of them over a user history.

Everything runs on jagged ``[T, dim]`` tokens with ``[B + 1]`` offsets: no padding, and a sample's
output does not depend on the other samples of its batch (GDPA normalises pointwise attention by each
sequence's own length).

Legend: ``T`` tokens over the batch, ``B`` sequences, ``H`` heads, ``Dqk`` / ``Dv`` per-head
query-key / value widths, ``S`` the tensor-parallel size (sequence parallelism: ``T / S`` tokens a rank).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_gem import jagged
from lightning_gem.data.balancing import AttentionCostModel
from lightning_gem.flops import attention_cost_coefficients, linear_flops
from lightning_gem.ops import gdpa
from lightning_gem.ops._launch import next_power_of_2
from lightning_gem.ops.attention import ACTIVATIONS, IMPLS, PRECISIONS
from lightning_gem.ops.pointwise import IMPLS as POINTWISE_IMPLS
from lightning_gem.ops.pointwise import norm, norm_mul, norm_residual, silu_split

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

__all__ = [
    "HSTULayer",
    "check_option",
    "JaggedHistoryEncoder",
    "RMSNorm",
    "RelativePositionBias",
    "RelativeTimeBias",
    "compile_hstu_layers",
    "make_norm",
    "norm_for_linear",
    "norm_for_residual",
    "pointwise_beside",
    "pad_tokens_to_multiple",
    "recency_positions",
    "relative_bias_attention",
    "relative_time_buckets",
    "time_buckets",
]

NormKind = Literal["rms", "layer"]

# The pointwise ops' impl beside each attention impl (HSTULayer's ``pointwise_impl=None``).
_POINTWISE_BESIDE = {"reference": "reference", "padded": "reference", "triton": "triton"}


def pointwise_beside(attention_impl: str) -> str:
    """The pointwise ops' impl (:mod:`lightning_gem.ops.pointwise`) beside a GDPA ``attention_impl``: PyTorch's
    unfused ops (``"reference"``) beside the reference and padded attention (oracle and baseline), ``"triton"``
    beside ``"triton"``, else ``"auto"`` (the kernels on CUDA)."""
    return _POINTWISE_BESIDE.get(attention_impl, "auto")


class RMSNorm(nn.RMSNorm):
    """``nn.RMSNorm`` whose weight follows its input's dtype.

    Under autocast a norm often gets a bf16 input (an attention output, a linear's) while its weight stays
    fp32. ``torch.rms_norm`` then falls back to its unfused composite: several more kernels a norm per training
    step, and more device time. Casting the weight to the input's dtype first, as autocast does for a
    linear's weight, keeps the fused kernel (which accumulates in fp32).
    """

    def forward(self, x: Tensor) -> Tensor:
        weight = self.weight
        if weight is not None and weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return F.rms_norm(x, self.normalized_shape, weight, self.eps)


def record_attention_stats(module: nn.Module, q: Tensor, k: Tensor, v: Tensor, kv_offsets: Tensor) -> None:
    """Add the FP8 quantization counts of a layer's attention operands to ``module.quant_stats`` (``[3, 4]``, rows
    q, k, v): what :class:`~lightning_gem.precision.QuantizationMonitor` reads on the steps it monitors (it sets
    ``module.collect_stats``)."""
    from lightning_gem.ops.attention.fp8 import quantization_stats

    counts = quantization_stats(q.detach(), k.detach(), v.detach(), kv_offsets).to(q.device)
    module.quant_stats = counts if module.quant_stats is None else module.quant_stats + counts


def check_option(value: object, name: str, allowed: tuple[str | None, ...]) -> str | None:
    """``value`` if it is one of ``allowed``, else a ``ValueError`` naming the option and every allowed value.

    For the options the components hand down (``activation``, ``attention_impl``, ``norm``; None where ``allowed``
    holds it): checked where the user sets them, so a typo fails at construction under its own name, not at the
    first batch inside GDPA.

    Example:
        >>> check_option("silu", "attention_activation", ("softmax", "silu"))
        'silu'
    """
    if (value is not None and not isinstance(value, str)) or value not in allowed:
        raise ValueError(f"`{name}` must be one of {', '.join(map(repr, allowed))}; got {value!r}")
    return value


_PLAIN_NORMS = (RMSNorm, nn.RMSNorm, nn.LayerNorm)
_PLAIN_PARAMETERS = (Tensor, nn.Parameter)  # not a tensor subclass (a sharded DTensor, a quantized weight)


def _norm_kind(module: nn.Module) -> str:
    """The ``kind`` of :mod:`lightning_gem.ops.pointwise`'s norms that ``module`` (from :func:`make_norm`) computes."""
    return "rms" if isinstance(module, nn.RMSNorm) else "layer"


def make_norm(kind: NormKind, dim: int, eps: float = 1e-6) -> nn.Module:
    """:class:`RMSNorm` (``"rms"``) or ``nn.LayerNorm`` (``"layer"``) over the last ``dim`` features."""
    if kind == "rms":
        return RMSNorm(dim, eps=eps)
    if kind == "layer":
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"`norm` must be 'rms' or 'layer', got {kind!r}")


def norm_for_linear(module: nn.Module, x: Tensor, impl: str = "auto") -> Tensor:
    """``module(x)`` for a Linear to read: under autocast, a float32 ``x`` normalised by a plain RMSNorm or LayerNorm
    comes out in the autocast dtype in one pass (:func:`lightning_gem.ops.pointwise.norm`), the values autocast's
    cast for the Linear would make of the norm's float32 output; anything else (no autocast, other input dtypes,
    other norm classes, such as the FP8 recipe's fused norms) is ``module(x)``. ``impl``: the pointwise ops' impl."""
    fused = _fused_norm(module, x)
    if fused is None:
        return module(x)
    kind, bias, dtype = fused
    return norm(x, module.weight, bias, eps=module.eps, kind=kind, out_dtype=dtype, impl=impl)


def norm_for_residual(module: nn.Module, x: Tensor, impl: str = "auto") -> tuple[Tensor, Tensor]:
    """``(norm_for_linear(module, x, impl), x)`` for a pre-norm residual block ``x + f(norm(x))``: take the second
    output as the residual. On the fused path the norm is :func:`lightning_gem.ops.pointwise.norm_residual`, whose
    backward adds the residual's gradient into the norm's in the same kernel; a norm fused with an FP8 Linear's
    quantization does the same through its ``forward_residual``."""
    fused = _fused_norm(module, x)
    if fused is None:
        forward_residual = getattr(module, "forward_residual", None)  # an FP8 Linear's fused norm adds it too
        return forward_residual(x) if forward_residual is not None else (module(x), x)
    kind, bias, dtype = fused
    return norm_residual(x, module.weight, bias, eps=module.eps, kind=kind, out_dtype=dtype, impl=impl)


def linear_silu_split(
    linear: nn.Module, x: Tensor, heads: int, sizes: tuple[int, ...], impl: str = "auto"
) -> tuple[Tensor, ...]:
    """``silu_split(linear(x).view(T, heads, -1), sizes)`` (:func:`lightning_gem.ops.pointwise.silu_split`). A plain
    ``nn.Linear`` with a bias (not converted, e.g. to FP8, nor sharded, nor hooked) gives its bias to the split instead
    of its matmul: the split's backward sums the bias's gradient in the pass that writes the projection's gradient,
    where the Linear's backward would read that gradient once more. ``impl``: the pointwise ops' impl
    (``"reference"``, PyTorch's unfused ops, keeps the Linear whole)."""
    bias = getattr(linear, "bias", None)
    moved = (
        impl != "reference"
        and type(linear) is nn.Linear
        and bias is not None
        and type(linear.weight) in _PLAIN_PARAMETERS
        and type(bias) in _PLAIN_PARAMETERS
        and not (linear._forward_hooks or linear._forward_pre_hooks)
    )
    y = F.linear(x, linear.weight) if moved else linear(x)
    y = y.view(y.shape[0], heads, sum(sizes))
    return silu_split(y, sizes, bias=bias.view(heads, sum(sizes)) if moved else None, impl=impl)


def _fused_norm(module: nn.Module, x: Tensor) -> tuple[str, Tensor | None, torch.dtype] | None:
    """``(kind, bias, autocast dtype)`` where :func:`norm_for_linear` takes the fused norm for ``module(x)``; else
    None."""
    device = x.device.type
    if x.dtype != torch.float32 or type(module) not in _PLAIN_NORMS or not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    if dtype == torch.float32 or len(module.normalized_shape) != 1:
        return None
    kind = _norm_kind(module)
    return kind, getattr(module, "bias", None) if kind == "layer" else None, dtype


class HSTULayer(nn.Module):
    """One HSTU layer (Zhai et al., 2024) on jagged tokens, attention through :func:`lightning_gem.ops.gdpa`.

    ``U, V, Q, K = split(SiLU(uvqk(norm(x))))``; ``A = gdpa(Q, K, V)`` (pointwise SiLU by default,
    causal, normalised by each sequence's length); ``y = x + dropout(output(attention_norm(A) * U))``.
    ``output`` starts at zero, so a fresh layer is the identity: a deep stack trains from the first step
    as fast as a shallow one (on the quickstart data, 2 layers reach val AUC 0.79 instead of 0.76 after
    300 steps).

    Tensor parallelism: :meth:`tensor_parallel_plan` names the column-wise (``uvqk``) and row-wise
    (``output``) linears. ``uvqk``'s output is laid out head-major (``[H, 2 Dv + 2 Dqk]``), so a
    column-wise shard holds whole heads; with ``per_head_norm=True`` (default) the attention-output norm
    is per head too, so a tensor-parallel layer needs no gather before ``output``. ``per_head_norm=False``
    normalises all heads together, as the HSTU paper does. Under sequence parallelism (see
    :meth:`JaggedHistoryEncoder.enable_sequence_parallel`) ``x`` and the output are this rank's share of the
    tokens: ``input_norm`` and the residual run on it, ``uvqk`` gathers every token before its matmul and
    ``output`` reduce-scatters back to shards (:meth:`tensor_parallel_token_local`).

    Args:
        dim: model width (input and output).
        num_heads: attention heads ``H``.
        attention_dim: per-head query/key width ``Dqk``; default ``dim // num_heads``.
        linear_dim: per-head value/gate width ``Dv``; default ``dim // num_heads``.
        activation: GDPA activation: ``"silu"`` (HSTU), ``"softmax"``, ``"gelu"``, ``"relu"``, ``"sigmoid"``.
        causal: mask future tokens.
        window: attend only to the ``window`` most recent earlier tokens (and self); None: unlimited.
        dropout: dropout on the layer's output before the residual.
        norm: ``"rms"`` or ``"layer"`` for the input and attention-output norms.
        per_head_norm: normalise the attention output per head (see above).
        attention_scale: GDPA score scale; None: ``1 / sqrt(attention_dim)``. The HSTU reference applies the
            activation to the raw scores (``1.0``).
        normalization_length: divide pointwise attention weights by this fixed length instead of each
            sequence's own length (the HSTU reference divides by its padded length ``N``); None: own length.
            Softmax attention ignores it.
        relative_bias_length: add a learned bias of the relative position ``t - i`` to every score (HSTU's
            relative attention bias over positions; distances beyond ``relative_bias_length - 1`` share the
            last value). The GDPA kernels take no additive bias, so such a layer attends through
            :func:`relative_bias_attention`: GDPA's ``score_bias`` on its dense path (``impl="padded"``, over
            ``[B, H, L, L]``), meant for short sequences (a few hundred events); ``num_targets`` and tensor
            parallelism are not supported with it.
        relative_time_buckets: add a learned bias of the time between the query's and the key's events to every
            score, one value per bucket of :func:`relative_time_buckets` (the time half of HSTU's relative
            attention bias); ``forward`` then needs ``time_buckets``. Dense path, as ``relative_bias_length``.
        attention_impl: GDPA ``impl`` (``"auto"``, ``"reference"``, ``"triton"``, or the ``"padded"`` baseline).
        attention_precision: GDPA ``precision`` (None, or ``"fp8"``: the attention's products on FP8 codes; what
            ``MXFP8Precision(attention=True)`` sets); not with a relative attention bias (the dense path).
        pointwise_impl: ``impl`` of the fused SiLU-split and norm-gate ops (:mod:`lightning_gem.ops.pointwise`);
            None: ``"reference"`` (PyTorch's unfused ops) beside the reference and padded attention (oracle and
            baseline), ``"triton"`` beside ``"triton"``, else ``"auto"`` (the kernels on CUDA).

    Shapes:
        x: ``[T, dim]`` (sequence parallel: ``[T / S, dim]``); offsets: ``[B + 1]``; num_targets: ``[B]`` or
        None. Output: the shape of ``x``.

    Example:
        >>> import torch
        >>> layer = HSTULayer(dim=16, num_heads=2)
        >>> x = torch.randn(5, 16)
        >>> layer(x, torch.tensor([0, 2, 2, 5])).shape
        torch.Size([5, 16])
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        *,
        attention_dim: int | None = None,
        linear_dim: int | None = None,
        activation: str = "silu",
        causal: bool = True,
        window: int | None = None,
        dropout: float = 0.0,
        norm: NormKind = "rms",
        per_head_norm: bool = True,
        attention_scale: float | None = None,
        normalization_length: int | None = None,
        relative_bias_length: int | None = None,
        relative_time_buckets: int | None = None,
        attention_impl: str = "auto",
        attention_precision: str | None = None,
        pointwise_impl: str | None = None,
    ) -> None:
        super().__init__()
        if normalization_length is not None and normalization_length < 1:
            raise ValueError(f"`normalization_length` must be >= 1, got {normalization_length}")
        if dim < 1 or num_heads < 1:
            raise ValueError(f"`dim` and `num_heads` must be >= 1, got dim={dim}, num_heads={num_heads}")
        if (attention_dim is None or linear_dim is None) and dim % num_heads:
            raise ValueError(
                f"`dim` ({dim}) must be divisible by `num_heads` ({num_heads}) unless both head dims are given"
            )
        self.num_heads = num_heads
        self.attention_dim = attention_dim if attention_dim is not None else dim // num_heads
        self.linear_dim = linear_dim if linear_dim is not None else dim // num_heads
        if self.attention_dim < 1 or self.linear_dim < 1:
            raise ValueError(
                f"head dims must be >= 1, got attention_dim={self.attention_dim}, linear_dim={self.linear_dim}"
            )
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"`dropout` must lie in [0, 1), got {dropout}")
        self.activation = check_option(activation, "activation", ACTIVATIONS)
        self.causal = causal
        self.window = window
        self.per_head_norm = per_head_norm
        if attention_scale is not None and not attention_scale > 0:
            raise ValueError(f"`attention_scale` must be > 0, got {attention_scale}")
        self.attention_scale = attention_scale
        self.normalization_length = normalization_length
        self.attention_impl = check_option(attention_impl, "attention_impl", IMPLS)
        self.pointwise_impl = check_option(pointwise_impl, "pointwise_impl", (None, *POINTWISE_IMPLS))

        self.input_norm = make_norm(norm, dim)
        self.uvqk = nn.Linear(dim, num_heads * (2 * self.linear_dim + 2 * self.attention_dim))
        self.attention_norm = make_norm(norm, self.linear_dim if per_head_norm else num_heads * self.linear_dim)
        self.output = nn.Linear(num_heads * self.linear_dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.relative_bias = None if relative_bias_length is None else RelativePositionBias(relative_bias_length)
        self.time_bias = None if relative_time_buckets is None else RelativeTimeBias(relative_time_buckets)
        self.attention_precision = check_option(attention_precision, "attention_precision", PRECISIONS)
        self.collect_stats, self.quant_stats = False, None  # FP8 attention's counts (record_attention_stats)
        if attention_precision is not None and (self.relative_bias is not None or self.time_bias is not None):
            raise ValueError("`attention_precision` needs GDPA's kernels; a relative bias takes the dense path")
        # The residual branch starts at zero: a fresh stack is the identity and learns as fast as a shallow one.
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    @staticmethod
    def norm_consumers() -> dict[str, str]:
        """Norm -> the Linear that reads its output (FP8 conversion fuses the norm's quantization into it); the
        attention norm feeds the gate product (:func:`lightning_gem.ops.pointwise.norm_mul`), not a Linear."""
        return {"input_norm": "uvqk"}

    @staticmethod
    def tensor_parallel_plan() -> dict[str, Literal["colwise", "rowwise"]]:
        """Submodule name -> how a tensor-parallel plan shards that ``nn.Linear``."""
        return {"uvqk": "colwise", "output": "rowwise"}

    @staticmethod
    def tensor_parallel_head_local() -> tuple[str, ...]:
        """Submodules replicated under tensor parallelism that run on each rank's own heads (the per-head
        attention norm): each rank's gradient of their parameters covers its heads only and the plan sums
        them over the tensor-parallel group."""
        return ("attention_norm",)

    @staticmethod
    def tensor_parallel_token_local() -> tuple[str, ...]:
        """Submodules replicated under tensor parallelism that run on each rank's own tokens under sequence
        parallelism (the input norm): each rank's gradient of their parameters covers its tokens only and
        the plan sums them over the tensor-parallel group."""
        return ("input_norm",)

    def forward(
        self,
        x: Tensor,
        offsets: Tensor,
        *,
        num_targets: Tensor | None = None,
        max_seq_len: int | None = None,
        check_offsets: bool = True,
        time_buckets: Tensor | None = None,
    ) -> Tensor:
        """Encode ``x [T, dim]`` (sequences by ``offsets [B + 1]``) to ``[T, dim]``.

        Args:
            x: ``[T, dim]`` tokens (sequence parallel: this rank's ``[T / S, dim]`` share).
            offsets: ``[B + 1]`` offsets of the sequences (of all ``T`` tokens).
            num_targets: ``[B]`` targets at the end of each sequence: they see the history and
                themselves only (see :func:`lightning_gem.ops.gdpa`).
            max_seq_len: an upper bound of the sequence lengths (a kernel hint, avoids a device sync).
            check_offsets: let GDPA validate the offsets (pass False when validated upstream).
            time_buckets: ``[B, L, L]`` bucket of each query-key pair's time gap, from
                :func:`relative_time_buckets` with ``L`` the ``max_seq_len`` given here (required iff the layer
                has ``relative_time_buckets``).
        """
        h, dv, dqk = self.num_heads, self.linear_dim, self.attention_dim
        pointwise = self.pointwise_impl or pointwise_beside(self.attention_impl)
        # The residual through the norm: its backward adds the residual's gradient into dx in the same pass.
        normed_TX, x = norm_for_residual(self.input_norm, x, pointwise)
        # uvqk sees every token, also of a sharded x. Then one pass: SiLU (after uvqk's bias), and U, V, Q, K each
        # contiguous; its backward writes d(uvqk) in one pass too, and uvqk's bias gradient beside it.
        u_THD, v_THD, q_THD, k_THD = linear_silu_split(self.uvqk, normed_TX, h, (dv, dv, dqk, dqk), pointwise)
        num_tokens = u_THD.shape[0]
        if self.time_bias is not None and time_buckets is None:
            raise ValueError("`time_buckets` is required: the layer was built with relative_time_buckets")
        if self.relative_bias is not None or self.time_bias is not None:
            if num_targets is not None:
                raise ValueError("`num_targets` is not supported with a relative attention bias")
            attn_THD = relative_bias_attention(
                q_THD,
                k_THD,
                v_THD,
                offsets,
                self.relative_bias,
                max_seq_len,
                activation=self.activation,
                causal=self.causal,
                window=self.window,
                scale=self.attention_scale,
                normalization_length=self.normalization_length,
                time_bias=self.time_bias,
                time_buckets=time_buckets,
                check_offsets=check_offsets,
            )
        else:
            if self.collect_stats and self.attention_precision == "fp8":
                record_attention_stats(self, q_THD, k_THD, v_THD, offsets)
            attn_THD = gdpa(
                q_THD,
                k_THD,
                v_THD,
                offsets,
                activation=self.activation,
                causal=self.causal,
                window=self.window,
                num_targets=num_targets,
                scale=self.attention_scale,
                normalization_length=None if self.activation == "softmax" else self.normalization_length,
                max_seq_len_q=max_seq_len,
                impl=self.attention_impl,
                check_offsets=check_offsets,
                precision=self.attention_precision,
            )
        norm = self.attention_norm
        if not self.per_head_norm:  # one norm over all heads of a token
            attn_THD, u_THD = attn_THD.reshape(num_tokens, 1, h * dv), u_THD.reshape(num_tokens, 1, h * dv)
        gated = norm_mul(
            attn_THD,
            u_THD,
            norm.weight,
            getattr(norm, "bias", None),
            eps=norm.eps,
            kind=_norm_kind(norm),
            impl=pointwise,
        )
        return x + self.dropout(self.output(gated.reshape(num_tokens, h * dv)))


class RelativePositionBias(nn.Module):
    """A learned score bias per relative position ``t - i`` (key minus query position within a sequence), the
    position half of HSTU's relative attention bias: ``weight [2 * length - 1]``, distances clamped to
    ``[-(length - 1), length - 1]``, initialised ``N(0, 0.02)``."""

    def __init__(self, length: int) -> None:
        super().__init__()
        if length < 1:
            raise ValueError(f"`relative_bias_length` must be >= 1, got {length}")
        self.length = length
        self.weight = nn.Parameter(torch.empty(2 * length - 1).normal_(std=0.02))

    def forward(self, size: int) -> Tensor:
        """``[size, size]``: the bias of query position ``i`` (rows) and key position ``t`` (columns)."""
        positions = torch.arange(size, device=self.weight.device)
        distance = (positions[None, :] - positions[:, None]).clamp(1 - self.length, self.length - 1)
        return self.weight[distance + self.length - 1]


class RelativeTimeBias(nn.Module):
    """A learned score bias per bucket of the time between a query's and a key's events, the time half of HSTU's
    relative attention bias: ``weight [num_buckets]``, initialised ``N(0, 0.02)``; buckets from
    :func:`relative_time_buckets`."""

    def __init__(self, num_buckets: int) -> None:
        super().__init__()
        if num_buckets < 1:
            raise ValueError(f"`relative_time_buckets` must be >= 1, got {num_buckets}")
        self.num_buckets = num_buckets
        self.weight = nn.Parameter(torch.empty(num_buckets).normal_(std=0.02))

    def forward(self, buckets: Tensor) -> Tensor:
        """``[B, 1, L, L]``: the bias of each query (rows) and key (columns) of ``buckets [B, L, L]``."""
        return self.weight[buckets.clamp(0, self.num_buckets - 1)][:, None]


def relative_time_buckets(timestamps: Tensor, offsets: Tensor, size: int, num_buckets: int) -> Tensor:
    """``[B, size, size]`` int64 :func:`time_buckets` of ``|t_query(i) - t(j)|`` for positions ``i`` (rows) and ``j``
    (columns) of each sequence, as the HSTU reference's relative attention bias buckets them.

    ``t(j)`` is event ``j``'s time; ``t_query(i)`` is the time of the event position ``i`` predicts, the next one
    (``t(i + 1)``), and the last position's own time: at inference the next event's time is the request's, which
    the history does not hold. Entries past a sequence's end are arbitrary (the attention masks them).

    Args:
        timestamps: ``[T]`` event times in seconds (any origin per sequence: only differences count).
        offsets: ``[B + 1]`` offsets of the sequences.
        size: ``L``, at least the longest sequence (the attention's padded length).
        num_buckets: buckets (the last one takes every longer gap).
    """
    num_tokens = timestamps.shape[0]
    lengths = jagged.offsets_to_lengths(offsets).to(torch.int64)
    size = max(1, size)
    positions = torch.arange(size, device=timestamps.device)
    starts = offsets[:-1, None].to(torch.int64)
    last = (lengths[:, None] - 1).clamp_min(0)
    if num_tokens == 0:
        return torch.zeros(lengths.shape[0], size, size, dtype=torch.int64, device=last.device)
    key_BL = timestamps[(starts + positions[None, :].minimum(last)).clamp(max=num_tokens - 1)].float()
    query_BL = timestamps[(starts + (positions[None, :] + 1).minimum(last)).clamp(max=num_tokens - 1)].float()
    return time_buckets((query_BL[:, :, None] - key_BL[:, None, :]).abs(), num_buckets)


def relative_bias_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    offsets: Tensor,
    bias: RelativePositionBias | None,
    max_seq_len: int | None = None,
    *,
    activation: str = "silu",
    causal: bool = True,
    window: int | None = None,
    scale: float | None = None,
    normalization_length: int | None = None,
    time_bias: RelativeTimeBias | None = None,
    time_buckets: Tensor | None = None,
    check_offsets: bool = True,
) -> Tensor:
    """GDPA self-attention with ``bias(t - i)`` (and ``time_bias(time_buckets)``, ``[B, L, L]`` from
    :func:`relative_time_buckets`) added to every score: ``[T, H, Dv]``.

    The biases become :func:`lightning_gem.ops.gdpa`'s ``score_bias`` over ``[B, H, L, L]`` padded scores
    (``L`` = ``max_seq_len``, or the longest sequence, read from the device), which its dense path
    (``impl="padded"``) computes. No device sync with ``max_seq_len`` given and ``check_offsets=False``;
    memory and time grow with ``B L^2``: meant for short sequences until the kernels take a bias.
    ``normalization_length`` divides pointwise weights by that fixed length instead of each sequence's own
    (see :class:`HSTULayer`; softmax ignores it).

    Raises:
        ValueError: an unknown activation, or ``time_buckets`` missing or not ``[B, L, L]``.
    """
    size = max(1, jagged.max_length(offsets) if max_seq_len is None else max_seq_len)
    if time_bias is not None and (time_buckets is None or time_buckets.shape != (offsets.shape[0] - 1, size, size)):
        got = None if time_buckets is None else tuple(time_buckets.shape)
        raise ValueError(f"`time_buckets` must be [B, L, L] = [{offsets.shape[0] - 1}, {size}, {size}], got {got}")
    score_bias = None if bias is None else bias(size)  # [L, L]
    if time_bias is not None:
        time_B1LL = time_bias(time_buckets)
        score_bias = time_B1LL if score_bias is None else score_bias + time_B1LL
    if score_bias is None:  # no bias given: the same dense path, adding zeros
        score_bias = q.new_zeros(size, size, dtype=torch.float32)
    return gdpa(
        q,
        k,
        v,
        offsets,
        activation=activation,
        causal=causal,
        window=window,
        scale=scale,
        score_bias=score_bias,
        normalization_length=None if activation == "softmax" else normalization_length,
        max_seq_len_q=size,
        impl="padded",
        check_offsets=check_offsets,
    )


def pad_tokens_to_multiple(
    x: Tensor, offsets: Tensor, multiple: int, num_targets: Tensor | None = None, max_seq_len: int | None = None
) -> tuple[Tensor, Tensor, Tensor | None, int | None]:
    """Append zero tokens to ``x [T, D]`` up to a multiple of ``multiple`` rows, as a sequence of their own.

    The padding is one extra sequence (``offsets`` gains an entry, ``num_targets`` a 0, ``max_seq_len`` covers
    its length), so sequence-local ops (attention) and token-local ops (norms, linears) give the real tokens
    the outputs they would have without it; they are the first ``T`` rows of any output. Nothing is
    appended when ``T`` is a multiple already.

    Returns:
        ``(x, offsets, num_targets, max_seq_len)``, padded.

    Example:
        >>> import torch
        >>> x, offsets, _, _ = pad_tokens_to_multiple(torch.ones(3, 2), torch.tensor([0, 1, 3]), 4)
        >>> x.shape, offsets.tolist()
        (torch.Size([4, 2]), [0, 1, 3, 4])
    """
    if multiple < 1:
        raise ValueError(f"`multiple` must be >= 1, got {multiple}")
    pad = -x.shape[0] % multiple
    if pad == 0:
        return x, offsets, num_targets, max_seq_len
    x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])])
    offsets = torch.cat([offsets, offsets[-1:] + pad])  # no read of offsets[-1] (a device sync)
    if num_targets is not None:
        num_targets = torch.cat([num_targets, num_targets.new_zeros(1)])
    if max_seq_len is not None:
        max_seq_len = max(max_seq_len, pad)
    return x, offsets, num_targets, max_seq_len


def _shard_tokens(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """This rank's contiguous share of the rows of ``x`` (the same on every rank of ``mesh``); backward
    all-gathers the shares' gradients, so what computed ``x`` gets the whole gradient on every rank."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).redistribute(mesh, [Shard(0)]).to_local()


def _gather_tokens(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """The rows of every rank's ``x`` over ``mesh``, in rank order; backward keeps this rank's rows of the
    gradient (what follows runs the same on every rank, so its gradient is whole, not partial)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    return DTensor.from_local(x, mesh, [Shard(0)], run_check=False).redistribute(mesh, [Replicate()]).to_local()


def recency_positions(
    offsets: Tensor, max_length: int, num_targets: Tensor | None = None, num_tokens: int | None = None
) -> Tensor:
    """``[T]`` int64 position of each token counted from the end of its history, capped at ``max_length``.

    The most recent history token is 1, the one before 2, ... (``min(., max_length)``); target tokens
    (the last ``num_targets[b]`` of sequence ``b``) are 0. Pass ``num_tokens`` (``T``) to avoid reading
    ``offsets[-1]`` (a device sync).
    """
    lengths = jagged.offsets_to_lengths(offsets).to(torch.int64)
    if num_tokens is None:
        num_tokens = int(offsets[-1])
    seg, local = jagged.segment_positions(offsets, num_tokens)
    history = lengths if num_targets is None else lengths - num_targets.to(torch.int64)
    return (history[seg] - local).clamp(0, max_length)


def time_buckets(time_deltas: Tensor, num_buckets: int) -> Tensor:
    """``[T]`` int64 log-scale bucket of each time delta in seconds: ``floor(2 * log2(1 + max(dt, 0)))``.

    Two buckets per doubling (64 buckets reach ~136 years); clamped to ``[0, num_buckets - 1]``; NaN -> 0.
    """
    seconds = torch.nan_to_num(time_deltas.to(torch.float32), nan=0.0).clamp_min(0.0)
    return torch.floor(2.0 * torch.log2(1.0 + seconds)).clamp(0, num_buckets - 1).to(torch.int64)


def compile_hstu_layers(module: nn.Module) -> list[str]:
    """``torch.compile`` every :class:`HSTULayer` in ``module`` in place, with dynamic shapes; returns their names.

    ``nn.Module.compile`` keeps each layer's class, names, parameters and ``state_dict``, so activation
    checkpointing (applied before) and FSDP2 (after) compose with it; with ``dynamic=True`` a new jagged token
    count or longest length reuses the graph instead of recompiling. Idempotent.
    """
    names = [name for name, sub in module.named_modules() if isinstance(sub, HSTULayer)]
    for name in names:
        layer = module.get_submodule(name)
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(dynamic=True)
    return names


class JaggedHistoryEncoder(nn.Module):
    """A stack of :class:`HSTULayer` over jagged history tokens, with recency and time encodings.

    ``x = dropout(input_proj(features) + position[p] (+ time[bucket(dt)]))``, then the layers, then a
    final norm (``input_proj`` is the identity when ``input_dim`` is None, the final norm when ``final_norm``
    is False). With ``position_encoding="recency"`` (default) positions count from the end of the history (the
    most recent event is 1, targets 0), capped at ``max_length``: what a ranker scoring targets after a
    history wants. ``"absolute"`` counts from the start (the first event is 0), as causal next-item training
    wants: every position then predicts from the encoding it will have at inference, whereas recency tells
    each training position how many events follow it.

    Sequence parallelism (:meth:`enable_sequence_parallel`): the layers run on token shards of a
    tensor-parallel mesh.

    Args:
        input_dim: width of the per-token input features (e.g. concatenated feature embeddings); None:
            the inputs are already ``dim`` wide (e.g. summed per-feature projections) and are not projected.
        dim: model width.
        num_layers: HSTU layers.
        num_heads: heads per layer.
        max_length: positions beyond it share the last position embedding.
        attention_dim, linear_dim, activation, causal, window, norm, per_head_norm, attention_scale, attention_impl:
            see :class:`HSTULayer`.
        dropout: dropout on the input and on each layer's output.
        relative_attention_bias: every layer adds a learned bias of the relative position to its scores
            (:class:`RelativePositionBias` over ``max_length`` positions; a dense attention path, see
            :class:`HSTULayer`).
        position_encoding: ``"recency"`` or ``"absolute"`` (see above).
        fixed_attention_normalization: pointwise attention divided by ``max_length`` instead of each
            sequence's own length (the HSTU reference's ``1 / N``; see :class:`HSTULayer`).
        use_time: add an embedding of ``time_buckets(time_deltas)``; ``forward`` then needs ``time_deltas``.
        relative_time_bias: every layer adds a learned bias of the time between the query's and the key's
            events to its scores (:class:`RelativeTimeBias`, the time half of HSTU's relative attention bias; a
            dense attention path, see :class:`HSTULayer`); ``forward`` then needs ``timestamps``.
        num_time_buckets: buckets of the time encoding and of the relative time bias.
        final_norm: normalise the last layer's output (False: return it as it is, as the HSTU reference,
            whose retrieval head L2-normalises it anyway).

    Shapes:
        features: ``[T, input_dim]``; offsets ``[B + 1]``; time_deltas ``[T]``; timestamps ``[T]``;
        num_targets ``[B]``. Output ``[T, dim]``.

    Example:
        >>> import torch
        >>> encoder = JaggedHistoryEncoder(input_dim=24, dim=16, num_layers=2, num_heads=2, max_length=8)
        >>> offsets = torch.tensor([0, 3, 3, 4])  # lengths 3, 0, 1
        >>> encoder(torch.randn(4, 24), offsets).shape
        torch.Size([4, 16])
    """

    def __init__(
        self,
        input_dim: int | None,
        dim: int = 64,
        num_layers: int = 2,
        num_heads: int = 2,
        *,
        max_length: int = 256,
        attention_dim: int | None = None,
        linear_dim: int | None = None,
        activation: str = "silu",
        causal: bool = True,
        window: int | None = None,
        dropout: float = 0.0,
        norm: NormKind = "rms",
        per_head_norm: bool = True,
        attention_scale: float | None = None,
        relative_attention_bias: bool = False,
        position_encoding: Literal["recency", "absolute"] = "recency",
        fixed_attention_normalization: bool = False,
        use_time: bool = False,
        relative_time_bias: bool = False,
        num_time_buckets: int = 64,
        attention_impl: str = "auto",
        final_norm: bool = True,
    ) -> None:
        super().__init__()
        if position_encoding not in ("recency", "absolute"):
            raise ValueError(f"`position_encoding` must be 'recency' or 'absolute', got {position_encoding!r}")
        if (input_dim is not None and input_dim < 1) or dim < 1:
            raise ValueError(f"`input_dim` and `dim` must be >= 1, got input_dim={input_dim}, dim={dim}")
        if num_layers < 0:
            raise ValueError(f"`num_layers` must be >= 0, got {num_layers}")
        if max_length < 1:
            raise ValueError(f"`max_length` must be >= 1, got {max_length}")
        if (use_time or relative_time_bias) and num_time_buckets < 1:
            raise ValueError(f"`num_time_buckets` must be >= 1, got {num_time_buckets}")
        self.input_dim = dim if input_dim is None else input_dim
        self.dim = dim
        self.max_length = max_length
        self.position_encoding = position_encoding
        self.num_time_buckets = num_time_buckets
        self.input_proj = nn.Identity() if input_dim is None else nn.Linear(input_dim, dim)
        self.position = nn.Embedding(max_length + 1, dim)
        self.time = nn.Embedding(num_time_buckets, dim) if use_time else None
        nn.init.normal_(self.position.weight, std=0.02)
        if self.time is not None:
            nn.init.normal_(self.time.weight, std=0.02)
        self.input_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleList(
            HSTULayer(
                dim,
                num_heads,
                attention_dim=attention_dim,
                linear_dim=linear_dim,
                activation=activation,
                causal=causal,
                window=window,
                dropout=dropout,
                norm=norm,
                per_head_norm=per_head_norm,
                attention_scale=attention_scale,
                normalization_length=max_length if fixed_attention_normalization else None,
                relative_bias_length=max_length if relative_attention_bias else None,
                relative_time_buckets=num_time_buckets if relative_time_bias else None,
                attention_impl=attention_impl,
            )
            for _ in range(num_layers)
        )
        self.final_norm = make_norm(norm, dim) if final_norm else nn.Identity()
        self.relative_time_bias = relative_time_bias
        self._sequence_parallel_mesh: DeviceMesh | None = None

    def enable_sequence_parallel(self, tp_mesh: DeviceMesh) -> None:
        """Run the layers on token shards over ``tp_mesh`` (Megatron-style sequence parallelism), in place.

        The encoder input is computed on every token; before the first layer, the tokens are padded to a
        multiple of the mesh size (:func:`pad_tokens_to_multiple`) and each rank keeps its contiguous share;
        after the last layer, the shares are gathered and the padding dropped, and ``final_norm`` runs on
        every token. The layers must be tensor-parallel over ``tp_mesh`` with a sequence-parallel plan
        (the strategy's ``sequence_parallel=True``: ``uvqk`` takes token shards, ``output`` returns them),
        and the gradients of their :meth:`HSTULayer.tensor_parallel_token_local` parameters summed over it.
        """
        self._sequence_parallel_mesh = tp_mesh

    def compile_layers(self) -> list[str]:
        """``torch.compile`` each layer in place, with dynamic shapes (:func:`compile_hstu_layers`); returns their
        names. ``GEM5DStrategy(compile_layers=True)`` calls this between tensor parallelism and FSDP2."""
        return compile_hstu_layers(self.layers)

    def _layers_compiled(self) -> bool:
        return any(getattr(layer, "_compiled_call_impl", None) is not None for layer in self.layers)

    @property
    def use_time(self) -> bool:
        return self.time is not None

    def sample_cost_model(self, backward: bool = True) -> AttentionCostModel:
        """Training FLOPs of one sequence of ``len`` tokens through this stack: ``a * len + b * len**2``.

        The layers' ``a`` and ``b`` come from :func:`lightning_gem.flops.attention_cost_coefficients` (the
        same formulas the FLOP counter uses), plus ``input_proj``'s FLOPs per token. A ``window`` caps
        each query's keys; the quadratic term then overestimates long sequences, which only makes
        the balancer pair them more conservatively. ``GEMDataModule`` balances ranks with this.

        Args:
            backward: forward + backward FLOPs (False: forward only).
        """
        a = 0.0
        if isinstance(self.input_proj, nn.Linear):
            a = float(linear_flops(1, self.input_dim, self.dim)) * (3.0 if backward else 1.0)
        b = 0.0
        for layer in self.layers:
            layer_a, layer_b = attention_cost_coefficients(
                self.dim,
                1,
                num_heads=layer.num_heads,
                attention_dim=layer.attention_dim,
                linear_dim=layer.linear_dim,
                causal=layer.causal,
                backward=backward,
            )
            a, b = a + layer_a, b + layer_b
        if b == 0.0:  # no layers: cost is linear in the length
            a = max(a, 1.0)
        return AttentionCostModel(a=a, b=b)

    def forward(
        self,
        features: Tensor,
        offsets: Tensor,
        *,
        time_deltas: Tensor | None = None,
        num_targets: Tensor | None = None,
        max_seq_len: int | None = None,
        check_offsets: bool = True,
        timestamps: Tensor | None = None,
    ) -> Tensor:
        """Encode ``features [T, input_dim]`` to ``[T, dim]``.

        Args:
            features: ``[T, input_dim]`` per-token inputs.
            offsets: ``[B + 1]`` offsets of the sequences.
            time_deltas: ``[T]`` seconds between each event and the request (required iff ``use_time``).
            timestamps: ``[T]`` each event's time in seconds (required iff ``relative_time_bias``).
            num_targets: ``[B]`` targets at the end of each sequence (see :class:`HSTULayer`).
            max_seq_len: an upper bound of the sequence lengths, passed to GDPA as a kernel hint.
            check_offsets: validate ``offsets`` and ``max_seq_len`` here, once (a device sync; ``num_targets``
                adds one more); the layers then get the exact longest length read in that sync as their hint.
        """
        jagged.check_floating(features, "features")
        if features.dim() != 2 or features.shape[1] != self.input_dim:
            raise ValueError(f"`features` must be [T, {self.input_dim}], got shape {tuple(features.shape)}")
        check_offsets = check_offsets and not torch.compiler.is_compiling()
        if check_offsets:  # offsets and the length hint, one device sync; the longest sequence is the layers' hint
            jagged.check_device(offsets, "offsets", features.device)
            (max_seq_len,) = jagged.validate_offsets_together([(offsets, "offsets", features.shape[0], max_seq_len)])
        if self.position_encoding == "recency":
            positions = recency_positions(offsets, self.max_length, num_targets, num_tokens=features.shape[0])
        else:
            positions = jagged.segment_positions(offsets, features.shape[0])[1].clamp(max=self.max_length)
        x = self.input_proj(features) + self.position(positions)
        if self.time is not None:
            if time_deltas is None:
                raise ValueError("`time_deltas` ([T] seconds) is required: the encoder was built with use_time=True")
            if time_deltas.shape != (features.shape[0],):
                raise ValueError(f"`time_deltas` must be [T] = [{features.shape[0]}], got {tuple(time_deltas.shape)}")
            x = x + self.time(time_buckets(time_deltas, self.num_time_buckets))
        x = self.input_dropout(x)
        time_buckets_BLL = None
        if self.relative_time_bias and self.layers:
            if timestamps is None or timestamps.shape != (features.shape[0],):
                got = None if timestamps is None else tuple(timestamps.shape)
                raise ValueError(f"`timestamps` must be [T] = [{features.shape[0]}] (relative_time_bias), got {got}")
            if self._sequence_parallel_mesh is not None:
                raise ValueError("relative_time_bias is not supported with sequence parallelism")
            # The layers pad to the same length (read here once, not again in every layer).
            max_seq_len = max(1, jagged.max_length(offsets) if max_seq_len is None else max_seq_len)
            time_buckets_BLL = relative_time_buckets(timestamps, offsets, max_seq_len, self.num_time_buckets)
        mesh = self._sequence_parallel_mesh
        if mesh is not None:
            x, offsets, num_targets, max_seq_len = pad_tokens_to_multiple(
                x, offsets, mesh.size(), num_targets, max_seq_len
            )
            x = _shard_tokens(x, mesh)
        # Offsets and max_seq_len are validated above; num_targets (reading its values) by the first layer.
        check_targets = check_offsets and num_targets is not None
        if type(max_seq_len) is int and max_seq_len > 1 and time_buckets_BLL is None and self._layers_compiled():
            # A compiled layer's graph holds its int arguments as constants: a power-of-two bound (still an upper
            # bound of every length) keeps jagged batches to a few graphs instead of one per longest length.
            max_seq_len = next_power_of_2(max_seq_len)
        for index, layer in enumerate(self.layers):
            x = layer(
                x,
                offsets,
                num_targets=num_targets,
                max_seq_len=max_seq_len,
                check_offsets=check_targets and index == 0,
                time_buckets=time_buckets_BLL,
            )
        if mesh is not None:
            x = _gather_tokens(x, mesh)[: features.shape[0]]
        return self.final_norm(x)
