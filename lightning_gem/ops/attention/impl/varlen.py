"""GDPA through PyTorch's own FlashAttention-2 varlen kernels: one candidate of ``impl="auto"``.

The kernels behind ``torch.nn.attention.varlen.varlen_attn`` (``aten._flash_attention_forward`` and
``aten._flash_attention_backward``) ship with every CUDA build of PyTorch that has its flash backend, so ``auto``
can time them with nothing installed. They compute the same plain softmax modes as FlashAttention-4
(:func:`lightning_gem.ops.attention.impl.flash.unsupported`, and the same varlen arguments: int32 offsets,
BlockAttention as one segment per block, causal masks and windows aligned bottom-right), with equal head dims for
q, k and v, multiples of 8 up to 256.

Their log-sum-exp is ``[H, Tq]`` fp32, natural log, ``+inf`` for a row that sees no key: with ``natural_lse`` it is
handed on as it is, and a backward told so takes FlashAttention-4's as well (whose ``-inf`` for such rows becomes
``+inf`` first). Otherwise both directions speak the kit's base-2 one, as :mod:`.flash` does.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gem.ops._launch import device_capability
from lightning_gem.ops.attention.impl.flash import (
    lse_to_base2,
    mode_unsupported,
    no_work,
    varlen_arguments,
)
from lightning_gem.ops.attention.spec import Spec

__all__ = ["device_unsupported", "varlen_backward", "varlen_forward", "varlen_unsupported"]

_LN2 = math.log(2.0)


def varlen_unsupported(q: Tensor, v: Tensor, spec: Spec) -> str | None:
    """Why PyTorch's FlashAttention-2 cannot compute this call exactly (a phrase naming the argument), or None."""
    self_attention = spec.kv_offsets is spec.q_offsets
    reason = mode_unsupported(q, activation=spec.activation, block_size=spec.block_size, kv_index=spec.kv_index,
                              num_targets=spec.num_targets, self_attention=self_attention)  # fmt: skip
    return reason or device_unsupported(q, v)


def device_unsupported(q: Tensor, v: Tensor) -> str | None:
    """Why PyTorch's FlashAttention-2 cannot run on ``q``'s GPU at these head dims (a call whose mode it computes, on
    CUDA: :func:`lightning_gem.ops.attention.impl.flash.mode_unsupported`), or None."""
    major = device_capability(q.device)[0]
    if major < 8:
        return f"`q` on a GPU of compute capability {major}.x (PyTorch's FlashAttention-2 runs on 8.0 and later)"
    if not torch.backends.cuda.is_flash_attention_available() or not torch.backends.cuda.flash_sdp_enabled():
        return "`q` on CUDA without PyTorch's FlashAttention-2 (not built, or turned off by the flash SDP switch)"
    dim, dim_v = q.shape[2], v.shape[2]
    if dim != dim_v or dim % 8 or dim > 256:
        return (
            f"head dims ({dim}, {dim_v}) of `q` and `v` (PyTorch's FlashAttention-2: equal, multiples of 8 up to 256)"
        )
    return None


def _window(spec: Spec) -> dict[str, int]:
    """FlashAttention-2's window: ``(w, w)`` around the diagonal, ``(w, 0)`` when causal, -1 for unlimited."""
    left = -1 if spec.window is None else spec.window
    return dict(window_size_left=left, window_size_right=0 if spec.causal else left)


def varlen_forward(
    q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, need_lse: bool = True, natural_lse: bool = False
) -> tuple[Tensor, Tensor]:
    """FlashAttention-2's forward on validated inputs with length hints: ``(out [Tq, H, D], lse [H, Tq])``, the
    log-sum-exp in base 2, or its own natural-log one with ``natural_lse``; ``[H, 0]`` when not ``need_lse``."""
    num_q, heads = q.shape[0], q.shape[1]
    if no_work(q, v):
        lse = torch.full((heads, num_q if need_lse else 0), float("inf"), dtype=torch.float32, device=q.device)
        return q.new_zeros(num_q, heads, v.shape[2]), lse
    offsets = varlen_arguments(spec, num_q)
    out, lse, *_ = torch.ops.aten._flash_attention_forward(
        q, k, v, offsets["cu_seqlens_q"], offsets["cu_seqlens_k"], offsets["max_seqlen_q"], offsets["max_seqlen_k"],
        0.0, spec.causal, False, scale=spec.scale, **_window(spec),
    )  # fmt: skip
    if not need_lse:
        return out, lse[:, :0]
    return out, lse if natural_lse else lse_to_base2(lse, inplace=True)


def varlen_backward(
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
    """FlashAttention-2's backward from a forward's ``out`` and the kit's base-2 ``lse`` (a natural-log one, either
    library's, with ``natural_lse``): ``(dq, dk, dv)``. Not for ``spec.deterministic`` (its dQ adds up in any order
    unless PyTorch's deterministic mode is on)."""
    if no_work(q, v):
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    # Rows that see no key: +inf (exp(s - inf) = 0, no gradient); -inf there would make NaN of the masked scores.
    lse = lse.nan_to_num(posinf=float("inf"), neginf=float("inf")) if natural_lse else lse * _LN2
    offsets = varlen_arguments(spec, q.shape[0])
    rng_state, unused = q.new_empty(2, dtype=torch.uint64), q.new_empty(0)  # read only with dropout
    dq, dk, dv = torch.ops.aten._flash_attention_backward(
        grad_out.contiguous(), q, k, v, out, lse, offsets["cu_seqlens_q"], offsets["cu_seqlens_k"],
        offsets["max_seqlen_q"], offsets["max_seqlen_k"], 0.0, spec.causal, rng_state, unused, scale=spec.scale,
        **_window(spec),
    )  # fmt: skip
    return dq, dk, dv
