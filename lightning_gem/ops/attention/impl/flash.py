"""GDPA through FlashAttention-4's varlen kernels: ``impl="flash"``, and one candidate of ``impl="auto"``.

FlashAttention-4 (``flash-attn-4``, CuTe DSL; the optional ``[fa4]`` extra) computes GDPA's plain softmax modes
exactly, and only those are sent to it (:func:`unsupported` names what it cannot do):

- causal or bidirectional self-attention, with or without a ``window`` (FA4's ``(left, right)`` window around the
  diagonal: ``(w, w)``, or ``(w, 0)`` when causal);
- cross-attention (query segments over their own kv segments; FA4 aligns causal masks and windows bottom-right,
  as GDPA does: ``p(i) = i + Lk - Lq``);
- BlockAttention of self-attention: each ``block_size`` block of a segment is one varlen segment of its own (the
  block offsets are built on the device, no sync), inside which causal and window rules are unchanged.

Targets (``num_targets``), shared kv segments (``kv_index``) and pointwise activations have no FA4 kernel.

The log-sum-exp this module returns and takes follows the kit's kernels: ``[H, Tq]`` fp32 in base 2, ``+inf``
for a row that sees no key (FA4's own is natural-log with ``-inf`` there). So a forward by one backend can be
followed by the other's backward, which is how ``impl="auto"`` picks the forward and the backward separately.

FA4 is called through its varlen forward and backward functions (``_flash_attn_fwd`` / ``_flash_attn_bwd``, of
the pinned version, :mod:`lightning_gem.imports`), wrapped here as torch custom ops with fake impls and FLOP
formulas, so ``torch.compile`` and ``FlopCounterMode`` see one node each.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gem.imports import FA4_AVAILABLE, FA4_INSTALL
from lightning_gem.ops._launch import device_capability, plain_eager, records_graph
from lightning_gem.ops.attention.impl.derived import made_from
from lightning_gem.ops.attention.ops import register_flop_formulas
from lightning_gem.ops.attention.spec import HINTS_SCHEMA, MODE_SCHEMA, Spec, with_length_hints
from lightning_gem.ops.mx.saved import save_exact

__all__ = [
    "block_offsets",
    "device_unsupported",
    "flash_backward",
    "flash_forward",
    "gdpa_flash",
    "lse_to_base2",
    "mode_unsupported",
    "no_work",
    "require_flash",
    "unsupported",
    "varlen_arguments",
]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)


def unsupported(
    q: Tensor,
    v: Tensor,
    *,
    activation: str,
    block_size: int | None,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    self_attention: bool,
) -> str | None:
    """Why FA4 cannot compute this call exactly (a phrase naming the argument), or None when it can."""
    reason = mode_unsupported(q, activation=activation, block_size=block_size, kv_index=kv_index,
                              num_targets=num_targets, self_attention=self_attention)  # fmt: skip
    return reason or device_unsupported(q, v)


def device_unsupported(q: Tensor, v: Tensor) -> str | None:
    """Why FA4 cannot run on ``q``'s GPU at these head dims (a call whose mode it computes, on CUDA:
    :func:`mode_unsupported`), or None."""
    major = device_capability(q.device)[0]
    if major not in (9, 10, 11):
        return f"`q` on a GPU of compute capability {major}.x (FlashAttention-4 runs on 9.x, 10.x and 11.x)"
    dim, dim_v = q.shape[2], v.shape[2]
    fits = dim % 8 == 0 and dim_v % 8 == 0 and dim <= 256 and dim_v <= 256
    if major != 9:  # Blackwell kernels: up to 128, or 256 x 256
        fits = fits and (max(dim, dim_v) <= 128 or dim == dim_v == 256)
    if not fits:
        return f"head dims ({dim}, {dim_v}) of `q` and `v` (FlashAttention-4 on sm_{major}x: multiples of 8 up to 256)"
    return None


def mode_unsupported(
    q: Tensor,
    *,
    activation: str,
    block_size: int | None,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    self_attention: bool,
) -> str | None:
    """Why no FlashAttention varlen kernel (FA4's, or PyTorch's FA2) computes this call's mode exactly on ``q``'s
    dtype and device type (a phrase naming the argument), or None; each library adds its own GPU and head-dim rules.
    """
    if activation != "softmax":
        return f"`activation={activation!r}` (FlashAttention computes softmax attention only)"
    if num_targets is not None:
        return "`num_targets` (targets see the history and themselves only: no FlashAttention mask does that)"
    if kv_index is not None:
        return "`kv_index` (query segments sharing a kv segment)"
    if block_size is not None and not self_attention:
        return "`block_size` with cross-attention (blocks follow the query positions p(i) = i + Lk - Lq)"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"`q` of dtype {q.dtype} (FlashAttention kernels take float16 and bfloat16)"
    if not q.is_cuda:
        return f"`q` on {q.device} (FlashAttention kernels run on CUDA GPUs)"
    return None


def require_flash() -> None:
    """Raise ``ModuleNotFoundError`` with the install command unless FlashAttention-4 (pinned) imports."""
    if not FA4_AVAILABLE:
        raise ModuleNotFoundError(f"impl='flash' needs FlashAttention-4: {FA4_INSTALL} ({FA4_AVAILABLE})")


def block_offsets(offsets: Tensor, block_size: int, num_rows: int) -> Tensor:
    """Offsets of the ``block_size`` blocks of every segment (blocks aligned to each segment's start, the last one
    of a segment possibly shorter), as int32 ``[N + 1]`` with ``N = num_rows // block_size + B`` (a bound on the
    number of blocks that needs no sync): the slots past the last block are empty segments at ``num_rows``."""
    offsets = offsets.to(torch.int64)
    num_segments = offsets.shape[0] - 1
    lengths = offsets[1:] - offsets[:-1]
    per_segment = (lengths + block_size - 1) // block_size
    ends = per_segment.cumsum(0)  # blocks up to and including each segment
    bound = num_rows // block_size + num_segments  # sum(ceil(L / s)) <= floor(T / s) + B
    block = torch.arange(bound, device=offsets.device)
    segment = torch.searchsorted(ends, block, right=True)  # the segment holding each block; B past the last one
    held = segment.clamp_max(max(num_segments - 1, 0))
    starts = offsets[held] + (block - (ends[held] - per_segment[held])) * block_size
    starts = torch.where(segment < num_segments, starts, num_rows)
    return torch.cat([starts, starts.new_full((1,), num_rows)]).to(torch.int32)


def _int32(offsets: Tensor) -> Tensor:
    if offsets.dtype == torch.int32:  # already FA4's (and never kept: it would keep itself alive)
        return offsets
    return made_from(offsets, ("int32",), lambda: offsets.to(torch.int32))


def varlen_arguments(spec: Spec, num_q: int) -> dict[str, object]:
    """The varlen keywords of FlashAttention's kernels (FA4's names; PyTorch's FA2 takes the same values): int32
    cumulative lengths (BlockAttention: one segment per block) and Python-int maximum lengths."""
    if spec.block_size is not None:  # self-attention: queries and keys share the block segments
        size, offsets = spec.block_size, spec.q_offsets
        blocks = made_from(offsets, ("blocks", size, num_q), lambda: block_offsets(offsets, size, num_q))
        longest = min(spec.block_size, int(spec.max_seq_len_q))
        return dict(cu_seqlens_q=blocks, cu_seqlens_k=blocks, max_seqlen_q=longest, max_seqlen_k=longest)
    cu_q = _int32(spec.q_offsets)
    cu_k = cu_q if spec.kv_offsets is spec.q_offsets else _int32(spec.kv_offsets)
    return dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=int(spec.max_seq_len_q),
        max_seqlen_k=int(spec.max_seq_len_kv),
    )


def _window(causal: bool, window: int | None) -> dict[str, int | None]:
    """FA4's window keywords: ``(w, w)`` around the diagonal, ``(w, 0)`` when causal (FA4 sets the 0 itself)."""
    if window is None:
        return dict(window_size_left=None, window_size_right=None)
    return dict(window_size_left=window, window_size_right=None if causal else window)


def no_work(q: Tensor, v: Tensor) -> bool:
    """Whether a call has nothing to compute (no queries, no heads or no keys): the varlen kernels are not called."""
    return q.shape[0] == 0 or q.shape[1] == 0 or v.shape[0] == 0


def flash_forward(
    q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, need_lse: bool = True, natural_lse: bool = False
) -> tuple[Tensor, Tensor]:
    """FA4's forward on validated inputs (a softmax ``spec`` with its length hints, no kv index or targets):
    ``(out [Tq, H, Dv], lse [H, Tq])`` (the kit's base-2 log-sum-exp). ``need_lse=False`` (no backward will read
    it): FA4 runs its kernel without the log-sum-exp, returned as ``[H, 0]``. ``natural_lse``: FA4's own
    (natural log, ``-inf`` where a row sees nothing), for a backward told so (:func:`flash_backward`,
    :func:`lse_to_base2`): two launches fewer."""
    num_q, heads = q.shape[0], q.shape[1]
    if no_work(q, v):
        out = q.new_zeros(num_q, heads, v.shape[2])
        nothing = float("-inf") if natural_lse else float("inf")
        return out, torch.full((heads, num_q if need_lse else 0), nothing, dtype=torch.float32, device=q.device)
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q, k, v, **varlen_arguments(spec, num_q), softmax_scale=spec.scale, causal=spec.causal,
        **_window(spec.causal, spec.window), return_lse=need_lse,
    )  # fmt: skip
    if not need_lse:
        return out, torch.empty(heads, 0, dtype=torch.float32, device=q.device)
    return out, lse if natural_lse else lse_to_base2(lse, inplace=True)


def lse_to_base2(lse: Tensor, *, inplace: bool = False) -> Tensor:
    """FA4's log-sum-exp (natural log, ``-inf`` where a row sees nothing) as the kit's: base 2, ``+inf`` there (two
    small launches)."""
    return (lse.mul_(_LOG2E) if inplace else lse * _LOG2E).nan_to_num_(posinf=float("inf"), neginf=float("inf"))


def flash_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spec: Spec,
    *,
    natural_lse: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """FA4's backward from a forward's ``out`` and the kit's base-2 ``lse`` (FA4's own with ``natural_lse``):
    ``(dq, dk, dv)``. The spec's ``deterministic`` is handed to FA4 (its dQ accumulation in a fixed order)."""
    if no_work(q, v):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    from flash_attn.cute.interface import _flash_attn_bwd

    # Base 2 -> natural; +inf stays +inf: exp(s - inf) = 0, the rows that see no key get no gradient.
    grads = _flash_attn_bwd(
        q, k, v, out, grad_out.contiguous(), lse if natural_lse else lse * _LN2, softmax_scale=spec.scale,
        causal=spec.causal,
        **_window(spec.causal, spec.window), **varlen_arguments(spec, q.shape[0]), deterministic=spec.deterministic,
    )  # fmt: skip
    return grads[0], grads[1], grads[2]


@torch.library.custom_op(
    "lightning_gem::gdpa_flash",
    mutates_args=(),
    schema=f"(Tensor q, Tensor k, Tensor v, {MODE_SCHEMA}, {HINTS_SCHEMA}) -> (Tensor, Tensor)",
)
def _gdpa_flash_op(q: Tensor, k: Tensor, v: Tensor, *spec: object) -> tuple[Tensor, Tensor]:
    return flash_forward(q, k, v, Spec(*spec))


@_gdpa_flash_op.register_fake
def _(q, k, v, *spec):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op(
    "lightning_gem::gdpa_flash_backward",
    mutates_args=(),
    schema=f"(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, {MODE_SCHEMA}, {HINTS_SCHEMA}) -> "
    "(Tensor, Tensor, Tensor)",
)
def _gdpa_flash_backward_op(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                            *spec: object) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    return flash_backward(grad_out, q, k, v, out, lse, Spec(*spec))


@_gdpa_flash_backward_op.register_fake
def _(grad_out, q, k, v, *args):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, q_offsets, kv_offsets, kv_index, num_targets, *options = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)
    save_exact(out, lse)  # the backward's dO . O against dP would cancel to noise in FP8 (quantized saves)
    ctx.save_for_backward(q, k, v, out, lse, q_offsets, kv_offsets, kv_index, num_targets)
    ctx.options = tuple(options)


def _backward(ctx, grad_out: Tensor | None, grad_lse: Tensor | None):
    q, k, v, out, lse, *jagged = ctx.saved_tensors
    if grad_out is None:
        grad_out = torch.zeros_like(out)
    dq, dk, dv = _gdpa_flash_backward_op(grad_out, q, k, v, out, lse, *jagged, *ctx.options)
    return dq, dk, dv, *(None,) * len(Spec._fields)


_gdpa_flash_op.register_autograd(_backward, setup_context=_setup_context)
register_flop_formulas(torch.ops.lightning_gem.gdpa_flash, torch.ops.lightning_gem.gdpa_flash_backward, saved_outputs=2)


class _FlashEager(torch.autograd.Function):
    """FA4's forward and backward without the custom ops' dispatch, for plain eager calls that record a graph
    (``plain_eager``: nothing traces or counts them), as the Triton path's eager Function: the dispatch and the
    ops' generated autograd wrapper cost host time and nothing else there, and FA4's own natural-log log-sum-exp
    goes from its forward to its backward as it is (the ops' output is the kit's base-2 one: two launches each way
    fewer)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
        out, lse = flash_forward(q, k, v, spec, natural_lse=True)
        ctx.mark_non_differentiable(lse)
        save_exact(out, lse)  # as the op's setup: the backward's dO . O against dP would cancel to noise in FP8
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec = spec
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = flash_backward(grad_out, q, k, v, out, lse, ctx.spec, natural_lse=True)
        return dq, dk, dv, None


def gdpa_flash(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, self_attention: bool) -> Tensor:
    """GDPA through FlashAttention-4 (``impl="flash"``), differentiable; inputs validated by
    :func:`lightning_gem.ops.gdpa`. A missing length hint is read from the offsets (one device sync).

    Raises:
        ModuleNotFoundError: FlashAttention-4 (the pinned version) is not installed; the message has the command.
        ValueError: a mode FlashAttention-4 does not compute exactly (the message names the argument).
    """
    reason = unsupported(q, v, activation=spec.activation, block_size=spec.block_size, kv_index=spec.kv_index,
                         num_targets=spec.num_targets, self_attention=self_attention)  # fmt: skip
    if reason is not None:
        raise ValueError(f"impl='flash' cannot compute {reason}; impl='triton' or impl='auto' can")
    require_flash()
    spec = with_length_hints(spec, q, k)
    if plain_eager((q, k, v, spec.q_offsets, spec.kv_offsets)):
        if records_graph(q, k, v):
            return _FlashEager.apply(q, k, v, spec)
        # Nothing will differentiate the call: FA4 runs without the log-sum-exp.
        return flash_forward(q, k, v, spec, need_lse=False)[0]
    return _gdpa_flash_op(q, k, v, *spec)[0]
