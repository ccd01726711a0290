"""Pure-PyTorch GDPA: the oracle every kernel is tested against. CPU or GPU, any float dtype.

Segments are grouped by the powers of two above their query and key lengths and padded only inside a
group, so memory is at most ~4x the sum over segments of ``Lq * Lk`` (times heads), never the padded
batch. Scores are computed in float32 (float64 for float64 inputs) and cast back at the end.

:func:`gdpa_reference` is differentiable by autograd; :func:`gdpa_reference_backward` is the explicit
backward (the formulas a kernel implements), used by the registered custom op.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_gem.ops.attention.masks import padded_mask, segments
from lightning_gem.ops.attention.spec import Spec

__all__ = ["ACTIVATIONS", "gdpa_reference", "gdpa_reference_backward"]


def _gelu_grad(x: Tensor) -> Tensor:
    cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
    pdf = torch.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)
    return cdf + x * pdf


def _silu_grad(x: Tensor) -> Tensor:
    sig = torch.sigmoid(x)
    return sig * (1.0 + x * (1.0 - sig))


def _sigmoid_grad(x: Tensor) -> Tensor:
    sig = torch.sigmoid(x)
    return sig * (1.0 - sig)


# activation -> (function, derivative)
POINTWISE = {
    "silu": (F.silu, _silu_grad),
    "gelu": (F.gelu, _gelu_grad),
    "relu": (F.relu, lambda x: (x > 0).to(x.dtype)),
    "sigmoid": (torch.sigmoid, _sigmoid_grad),
}
ACTIVATIONS = ("softmax", *POINTWISE)
_MIN_BUCKET = 16


@dataclass
class _Bucket:
    q_idx: Tensor  # [N, Lq] row of q for each padded query slot (clamped; see q_valid)
    k_idx: Tensor  # [N, Lk] row of k/v for each padded key slot (clamped; see k_valid)
    q_valid: Tensor  # [N, Lq]
    k_valid: Tensor  # [N, Lk]
    mask: Tensor  # [N, 1, Lq, Lk] allowed pairs
    len_k: Tensor  # [N, 1, 1, 1] kv segment lengths, at least 1 (pointwise normaliser)


def _pow2_bucket(length: Tensor) -> Tensor:
    length = length.clamp_min(_MIN_BUCKET)
    return torch.pow(2, torch.ceil(torch.log2(length.to(torch.float64)))).to(torch.int64)


def _buckets(num_q: int, num_k: int, spec: Spec) -> Iterator[_Bucket]:
    """Groups of segments with similar lengths, padded to the group's longest; skips empty work."""
    device = spec.q_offsets.device
    q_start, len_q, k_start, len_k, num_history = segments(
        spec.q_offsets, spec.kv_offsets, spec.kv_index, spec.num_targets
    )
    keys = _pow2_bucket(len_q) * (1 << 32) + _pow2_bucket(len_k)
    for key in torch.unique(keys).tolist():
        seg = torch.nonzero(keys == key).squeeze(1)
        pad_q, pad_k = int(len_q[seg].max()), int(len_k[seg].max())
        if pad_q == 0 or pad_k == 0:
            continue  # no query, or no key: those outputs stay zero
        q_pos = torch.arange(pad_q, device=device)
        k_pos = torch.arange(pad_k, device=device)
        lq, lk = len_q[seg, None], len_k[seg, None]
        mask = padded_mask(
            len_q[seg],
            len_k[seg],
            num_history[seg],
            pad_q,
            pad_k,
            causal=spec.causal,
            window=spec.window,
            block_size=spec.block_size,
        )
        yield _Bucket(
            q_idx=(q_start[seg, None] + q_pos).clamp_max(num_q - 1),
            k_idx=(k_start[seg, None] + k_pos).clamp_max(num_k - 1),
            q_valid=q_pos[None, :] < lq,
            k_valid=k_pos[None, :] < lk,
            mask=mask[None],
            # An empty kv segment can share a bucket with non-empty ones: its row of the mask is all
            # False, and dividing by 1 instead of 0 keeps its output at zero (0 / 0 would be NaN).
            len_k=lk.clamp_min(1)[None, :, :, None],
        )


def _probabilities(scores: Tensor, mask: Tensor, activation: str) -> Tensor:
    """``A`` of ``O = A V`` for one bucket: the masked softmax, or the masked ``act(S)`` (whose ``1 / Lk``
    is applied to the output instead: ``Lq x Dv`` multiplies instead of ``Lq x Lk``)."""
    if activation == "softmax":
        scores = scores.masked_fill(~mask, float("-inf"))
        row_max = scores.amax(dim=-1, keepdim=True).detach()
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        weights = torch.exp(scores - row_max)
        denom = weights.sum(dim=-1, keepdim=True)
        return weights / torch.where(denom > 0, denom, torch.ones_like(denom))
    act = POINTWISE[activation][0](scores)
    return torch.where(mask, act, torch.zeros_like(act))


def _gather(x_HTD: Tensor, idx: Tensor, compute: torch.dtype) -> Tensor:
    """Rows ``idx [N, L]`` of a head-major ``[H, T, D]`` tensor as ``[H, N, L, D]`` in ``compute``."""
    num_heads, dim = x_HTD.shape[0], x_HTD.shape[2]
    return x_HTD.index_select(1, idx.reshape(-1)).view(num_heads, *idx.shape, dim).to(compute)


def _compute_dtype(q: Tensor, override: torch.dtype | None) -> torch.dtype:
    if override is not None:
        return override
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _head_major(x: Tensor) -> Tensor:
    return x.transpose(0, 1).contiguous()


def gdpa_reference(q: Tensor, k: Tensor, v: Tensor, spec: Spec, *, compute_dtype: torch.dtype | None = None) -> Tensor:
    """GDPA forward on validated inputs (see :func:`lightning_gem.ops.gdpa` for the contract).

    Shapes: q ``[Tq, H, D]``, k ``[Tk, H, D]``, v ``[Tk, H, Dv]``; ``spec`` (:class:`~.spec.Spec`) holds the
    offsets, index, targets and mode (its length hints and ``deterministic`` are not needed). Returns ``[Tq, H, Dv]``.
    ``compute_dtype`` overrides the dtype every step runs in (default float32, float64 for float64 inputs):
    the inputs' own low precision gives the error budget of a same-precision computation in tests.
    """
    # Computes in float32 (float64 for float64 inputs) also under autocast, which is off inside.
    with torch.autocast(q.device.type, enabled=False):
        compute = _compute_dtype(q, compute_dtype)
        out = q.new_zeros(q.shape[0], q.shape[1], v.shape[2], dtype=compute)
        q_h, k_h, v_h = _head_major(q), _head_major(k), _head_major(v)
        rows, values = [], []
        for b in _buckets(q.shape[0], k.shape[0], spec):
            qb = _gather(q_h, b.q_idx, compute) * spec.scale  # [H, N, Lq, D]
            kb, vb = _gather(k_h, b.k_idx, compute), _gather(v_h, b.k_idx, compute)  # [H, N, Lk, D]
            scores = torch.matmul(qb, kb.transpose(-1, -2))  # [H, N, Lq, Lk]
            probs = _probabilities(scores, b.mask, spec.activation)
            ob = torch.matmul(probs, vb)  # [H, N, Lq, Dv]
            if spec.activation != "softmax":
                ob = ob / b.len_k
            rows.append(b.q_idx[b.q_valid])
            values.append(ob.permute(1, 2, 0, 3)[b.q_valid])  # [rows, H, Dv]
        if rows:
            out = out.index_put((torch.cat(rows),), torch.cat(values))
        return out.to(q.dtype)


def gdpa_reference_backward(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    spec: Spec,
    *,
    compute_dtype: torch.dtype | None = None,
    products: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
    out: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`gdpa_reference`, written out as a kernel computes them (in
    ``compute_dtype``, as :func:`gdpa_reference`).

    With ``S = scale Q K^T`` and ``O = P V`` (pointwise: ``P = mask * act(S) / Lk``): ``dV = P^T dO``,
    ``dP = dO V^T``; softmax: ``dS = P * (dP - rowsum(dO * O))``; pointwise: ``dS = mask * act'(S) * dP / Lk``; then
    ``dQ = scale dS K`` and ``dK = scale dS^T Q``. dk and dv add up over query segments sharing a kv segment.

    ``products`` ``(q', k', dO', v')``, shaped as ``q, k, grad_out, v``, replaces the operands of the two recomputed
    products, ``S = scale Q' K'^T`` and ``dP = dO' V'^T`` (GDPA's FP8 backward: their dequantized FP8 codes); the
    other products keep ``q, k, grad_out``. ``out``: softmax's ``rowsum(dO * O)`` from this forward output, as the
    kernels take it (default: ``rowsum(dP * P)``, which equals it for the exact forward).
    """
    # Computes in float32 (float64 for float64 inputs) also under autocast, which is off inside.
    with torch.autocast(q.device.type, enabled=False):
        compute = _compute_dtype(q, compute_dtype)
        dq = torch.zeros(q.shape, dtype=compute, device=q.device)
        dk = torch.zeros(k.shape, dtype=compute, device=k.device)
        dv = torch.zeros(v.shape, dtype=compute, device=v.device)
        q_h, k_h, g_h = _head_major(q), _head_major(k), _head_major(grad_out)
        if products is not None:
            qs_h, ks_h, gs_h, vs_h = (_head_major(t) for t in products)
        else:
            vs_h = _head_major(v)  # V enters dP only
        if out is not None:
            delta_h = _head_major((grad_out.to(compute) * out.to(compute)).sum(dim=-1, keepdim=True))
        for b in _buckets(q.shape[0], k.shape[0], spec):
            qb, kb = _gather(q_h, b.q_idx, compute), _gather(k_h, b.k_idx, compute)
            gb = _gather(g_h, b.q_idx, compute) * b.q_valid[None, :, :, None]  # padded query slots carry no grad
            vs = _gather(vs_h, b.k_idx, compute)
            if products is None:
                qs, ks, gs = qb, kb, gb
            else:
                qs, ks = _gather(qs_h, b.q_idx, compute), _gather(ks_h, b.k_idx, compute)
                gs = _gather(gs_h, b.q_idx, compute) * b.q_valid[None, :, :, None]
            scores = torch.matmul(qs * spec.scale, ks.transpose(-1, -2))  # [H, N, Lq, Lk]
            probs = _probabilities(scores, b.mask, spec.activation)
            if spec.activation == "softmax":
                dprobs = torch.matmul(gs, vs.transpose(-1, -2))
                # rowsum(dP * P) == rowsum(dO * O), as kernels compute it; this form is exact where a row
                # attends to a single key (its dS is then exactly zero).
                if out is None:
                    delta = (dprobs * probs).sum(dim=-1, keepdim=True)
                else:
                    delta = _gather(delta_h, b.q_idx, compute)
                dscores = probs * (dprobs - delta)
            else:
                gb = gb / b.len_k
                gs = gb if products is None else gs / b.len_k
                dprobs = torch.matmul(gs, vs.transpose(-1, -2))
                derivative = POINTWISE[spec.activation][1](scores)
                dscores = torch.where(b.mask, derivative * dprobs, torch.zeros_like(dprobs))
            dv_b = torch.matmul(probs.transpose(-1, -2), gb)  # [H, N, Lk, Dv]
            dq_b = torch.matmul(dscores, kb) * spec.scale
            dk_b = torch.matmul(dscores.transpose(-1, -2), qb) * spec.scale
            dq.index_put_((b.q_idx[b.q_valid],), dq_b.permute(1, 2, 0, 3)[b.q_valid])
            dk.index_put_((b.k_idx[b.k_valid],), dk_b.permute(1, 2, 0, 3)[b.k_valid], accumulate=True)
            dv.index_put_((b.k_idx[b.k_valid],), dv_b.permute(1, 2, 0, 3)[b.k_valid], accumulate=True)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
