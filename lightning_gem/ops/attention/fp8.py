"""FP8 attention: how GDPA's FP8 path quantizes its operands, and the reference that computes with those codes.

Every code is FP8 E4M3 (largest value 448) with an fp32 scale that is a power of two, so scaling is exact and every
implementation (PyTorch here, the Triton kernels) turns the same input into the same codes:

- ``q`` and ``k``: one scale per (token, head), the row's absolute maximum over 448 rounded up to a power of two.
  A kernel pays one multiply per score for it (``s_ij = scale * sq_i * sk_j * <q8_i, k8_j>``), and each token keeps
  its own range: one large token does not push the others into the subnormals.
- ``v``: one scale per (kv segment, head, channel). ``P V`` sums over keys, so a scale may vary over the channels
  only (it then scales the output's columns); per segment, so a sample's codes do not depend on the rest of its
  batch. Stored transposed, ``[H, Dv, *]`` with keys contiguous, each segment starting at a multiple of 16 keys
  (:func:`value_offsets`): sm_90's FP8 tensor cores read the second operand of a product K-major (the keys are that
  product's K), and aligned segment starts let a kernel read a tile's keys 16 bytes at a time.
- ``P``: softmax probabilities (``exp(s - running max)``) are at most 1 and are stored as ``256 p``. A pointwise
  activation's ``|act(s)|`` is at most ``max(|s|, 1)`` (SiLU, GELU, ReLU, sigmoid), and ``|s_ij| <= scale |q_i|
  max_j |k_j|`` (Cauchy-Schwarz, with the dequantized rows), so row ``i`` is stored as ``256 act(s) / b_i`` with
  ``b_i`` that bound (and at least 1) rounded up to a power of two: no code can overflow, whatever the inputs.
- Products accumulate in fp32; softmax's running max and sum are taken over the fp32 scores and probabilities.

:func:`gdpa_fp8_reference` computes exactly these codes' products in fp32 (the oracle of the kernels' FP8 path).
The kernels quantize ``P`` tile by tile against the running maximum, this reference against the row's final one, so
the two round different ``p`` and agree to FP8's rounding of ``P`` (about ``2^-4`` of each weight), not bit for bit.

The backward (:func:`gdpa_fp8_reference_backward`, the kernels' oracle there) recomputes ``S = scale Q K^T`` and
``dP = dO V^T`` on codes with one scale per (token, head) for all four operands (:func:`quantize_rows`: q and k get
the forward's own codes, so the rebuilt probabilities are the ones its log-sum-exp normalises; a per-channel scale of
v would lie along dP's summed dim). ``dV = P^T dO``, ``dK = scale dS^T Q`` and ``dQ = scale dS K`` sum over tokens,
along which a row scale varies, so they keep the inputs' dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from lightning_gem import jagged
from lightning_gem.ops.attention.spec import Spec

__all__ = [
    "E4M3_MAX",
    "OPERANDS",
    "P_SCALE",
    "FP8Operands",
    "gdpa_fp8",
    "dequantize_rows",
    "gdpa_fp8_reference",
    "gdpa_fp8_reference_backward",
    "pointwise_bound",
    "pow2_ceil",
    "pow2_scale",
    "quantization_stats",
    "quantize_fp8",
    "quantize_rows",
    "value_codes",
    "value_columns",
    "value_offsets",
]

E4M3_MAX = 448.0
P_SCALE = 256.0  # P's codes: 256 p for softmax (p <= 1), 256 act(s) / b_i for pointwise rows
E4M3 = torch.float8_e4m3fn
# Slack on the pointwise bound for the fp32 rounding of the norms it is made of (a few ulp; this is 2^-10).
BOUND_SLACK = 1.0 + 2.0**-10


class FP8Operands(NamedTuple):
    """Quantized ``q``, ``k``, ``v`` of one GDPA call (see the module docstring)."""

    q: Tensor  # [Tq, H, D] e4m3
    q_scale: Tensor  # [H, Tq] fp32, head-major: a tile's rows' scales are one contiguous run
    k: Tensor  # [Tk, H, D] e4m3
    k_scale: Tensor  # [H, Tk] fp32
    v_t: Tensor  # [H, Dv, value_columns] e4m3, keys contiguous, segment j from column v_offsets[j]
    v_offsets: Tensor  # [Bkv + 1] int64: the segments' first columns in v_t, multiples of 16
    v_scale: Tensor  # [Bkv, H, Dv] fp32
    k_norm: Tensor  # [Bkv, H] fp32: the largest |k_j| (dequantized) of each kv segment and head


def pow2_scale(amax: Tensor) -> Tensor:
    """The smallest power of two ``s`` with ``amax / s <= 448`` (fp32), from ``amax``'s bits: with ``amax = m 2^e``
    (``1 <= m < 2``) it is ``2^(e - 8)`` where ``m <= 1.75`` (``448 = 1.75 2^8``), else ``2^(e - 7)``. 1 where ``amax``
    is zero, subnormal or not finite. The Triton quantizer computes the same bits."""
    bits = amax.float().view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    exponent = torch.where((bits & 0x7FFFFF) > 0x600000, exponent - 7, exponent - 8)
    ok = ((bits >> 23) & 0xFF > 0) & ((bits >> 23) & 0xFF < 0xFF)
    exponent = torch.where(ok & (exponent > 0), exponent, torch.full_like(exponent, 127))
    return (exponent << 23).view(torch.float32)


def pow2_ceil(x: Tensor) -> Tensor:
    """The smallest power of two at or above ``x`` (fp32, positive and normal), from its bits."""
    bits = x.float().view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return (exponent << 23).view(torch.float32)


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``x [T, H, D]`` as E4M3 codes ``[T, H, D]`` with one scale per (token, head), ``[H, T]`` fp32 (head-major: a
    tile's rows' scales are one contiguous run): the rule of ``q`` and ``k`` in the module docstring."""
    with torch.no_grad():
        scale = pow2_scale(x.abs().amax(dim=2))
        return (x.float() / scale[:, :, None]).to(E4M3), scale.t().contiguous()


def dequantize_rows(codes: Tensor, scale: Tensor) -> Tensor:
    """fp32 values of :func:`quantize_rows`' ``codes [T, H, D]`` and ``scale [H, T]`` (exact)."""
    return codes.float() * scale.t()[:, :, None]


def quantize_fp8(q: Tensor, k: Tensor, v: Tensor, kv_offsets: Tensor) -> FP8Operands:
    """``q``, ``k``, ``v`` in the FP8 recipe of this module."""
    with torch.no_grad():
        q8, q_scale_h = quantize_rows(q)
        k8, k_scale_h = quantize_rows(k)
        k_scale = k_scale_h.t()
        num_kv, heads, dim_v = v.shape
        num_segments = kv_offsets.shape[0] - 1
        seg, position = jagged.segment_positions(kv_offsets, num_kv)  # validated offsets: every key in a segment
        v_amax = v.new_zeros(num_segments, heads, dim_v, dtype=torch.float32)
        v_amax.scatter_reduce_(0, seg[:, None, None].expand(num_kv, heads, dim_v), v.abs().float(), "amax")
        v_scale = pow2_scale(v_amax)
        v8 = (v.float() / v_scale[seg]).to(E4M3)
        v_offsets = value_offsets(kv_offsets)
        v_t = torch.zeros(heads, dim_v, value_columns(num_kv, num_segments), dtype=E4M3, device=v.device)
        v_t[:, :, v_offsets[seg] + position] = v8.permute(1, 2, 0)
        norms = torch.linalg.vector_norm(k8.float(), dim=2) * k_scale
        k_norm = norms.new_zeros(num_segments, heads)
        k_norm.scatter_reduce_(0, seg[:, None].expand(num_kv, heads), norms, "amax")
    return FP8Operands(q8, q_scale_h, k8, k_scale_h, v_t, v_offsets, v_scale, k_norm)


def value_offsets(kv_offsets: Tensor) -> Tensor:
    """``[Bkv + 1]`` first columns of the kv segments in the transposed value codes: each segment's length rounded up
    to 16, summed. No sync."""
    lengths = (kv_offsets[1:] - kv_offsets[:-1]).to(torch.int64)
    padded = (lengths + 15) // 16 * 16
    return torch.nn.functional.pad(padded.cumsum(0), (1, 0))


VALUE_TAIL = 128  # zero columns after the last segment: a kernel's key tile (up to 128 keys) never reads past them


def value_columns(num_kv: int, num_segments: int) -> int:
    """Columns of the transposed value codes, a multiple of 16: enough for any segmentation of ``num_kv`` keys into
    ``num_segments`` (from shapes alone: no sync), plus :data:`VALUE_TAIL`."""
    return (num_kv + 15) // 16 * 16 + 16 * num_segments + VALUE_TAIL


def value_codes(codes: FP8Operands, kv_offsets: Tensor) -> Tensor:
    """``[Tk, H, Dv]`` the value codes back in token order, as float32."""
    seg, position = jagged.segment_positions(kv_offsets, codes.k.shape[0])
    return codes.v_t[:, :, codes.v_offsets[seg] + position].permute(2, 0, 1).float()


OPERANDS = ("q", "k", "v")


def quantization_stats(q: Tensor, k: Tensor, v: Tensor, kv_offsets: Tensor) -> Tensor:
    """``[3, 4]`` int64 counts of ``q``, ``k``, ``v`` (rows) under this recipe: elements that saturated (over 448 times
    their scale: none can, the scales follow each block's maximum), underflowed (non-zero, code zero), sat in a block
    (a row of q or k, a segment's channel of v) with a NaN or Inf, and all elements (the columns of
    :data:`lightning_gem.precision.linear.STAT_NAMES`). One more quantization pass: for monitored steps."""
    with torch.no_grad():
        codes = quantize_fp8(q, k, v, kv_offsets)
        num_kv, heads, dim_v = v.shape
        seg = jagged.segment_ids(kv_offsets, num_kv)
        finite = torch.ones(kv_offsets.shape[0] - 1, heads, dim_v, dtype=torch.int32, device=v.device)
        finite.scatter_reduce_(0, seg[:, None, None].expand(num_kv, heads, dim_v), torch.isfinite(v).int(), "amin")
        rows = [
            (q, codes.q.float(), codes.q_scale.t()[:, :, None], ~torch.isfinite(q).all(dim=2, keepdim=True)),
            (k, codes.k.float(), codes.k_scale.t()[:, :, None], ~torch.isfinite(k).all(dim=2, keepdim=True)),
            (v, value_codes(codes, kv_offsets), codes.v_scale[seg], finite[seg] == 0),
        ]
        counts = []
        for x, x8, scale, bad_block in rows:
            x = x.float()
            saturated = int((torch.isfinite(x) & ((x.abs() / scale) > E4M3_MAX)).sum())
            underflowed = int(((x != 0) & (x8 == 0)).sum())
            nonfinite = int(bad_block.expand_as(x).sum())
            counts.append([saturated, underflowed, nonfinite, x.numel()])
    return torch.tensor(counts, dtype=torch.int64)


def pointwise_bound(q_norm: Tensor, k_norm: Tensor, scale: float) -> Tensor:
    """``b_i`` of a pointwise row: ``scale |q_i| max_j |k_j|`` (with slack for rounding), at least 1, rounded up to a
    power of two; ``256 act(s_ij) / b_i`` then lies in ``[-256, 256]``."""
    return pow2_ceil(torch.clamp_min(q_norm * k_norm * abs(scale) * BOUND_SLACK, 1.0))


class _FP8Reference(torch.autograd.Function):
    """:func:`gdpa_fp8_reference` forward; :func:`gdpa_fp8_reference_backward` backward."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
        out = gdpa_fp8_reference(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out)
        ctx.spec = spec
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        return (*gdpa_fp8_reference_backward(grad_out, *ctx.saved_tensors, ctx.spec), None)


def gdpa_fp8(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """``impl="reference"`` with ``precision="fp8"``: :func:`gdpa_fp8_reference`, differentiable by
    :func:`gdpa_fp8_reference_backward` (the gradients the Triton path computes)."""
    return _FP8Reference.apply(q, k, v, spec)


def gdpa_fp8_reference_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, spec: Spec
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of GDPA's FP8 path as its kernels compute them, in fp32 (the oracle of the Triton backward).

    The two products the backward recomputes run on FP8 codes with one scale per (token, head)
    (:func:`quantize_rows`): ``S = scale Q8 K8^T`` (the codes of the forward's ``S``, so the rebuilt ``P`` is the one
    the forward's log-sum-exp normalises) and ``dP = dO8 V8^T``. The three that make the gradients,
    ``dV = P^T dO``, ``dK = scale dS^T Q`` and ``dQ = scale dS K``, keep the unquantized ``dO``, ``Q`` and ``K``
    (in the kernels: the inputs' dtype), and softmax's ``rowsum(dO * O)`` takes the FP8 forward's ``out``.
    """
    from lightning_gem.ops.attention.impl.reference import gdpa_reference_backward

    products = tuple(dequantize_rows(*quantize_rows(t)) for t in (q, k, grad_out, v))
    return gdpa_reference_backward(grad_out, q, k, v, spec, products=products, out=out)


def gdpa_fp8_reference(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    """GDPA on the FP8 codes of ``q``, ``k``, ``v`` (:func:`quantize_fp8`), with ``P`` quantized as the recipe says,
    every product exact and summed in fp32. Returns ``[Tq, H, Dv]`` in q's dtype. Not differentiable."""
    with torch.autocast(q.device.type, enabled=False):  # fp32 products under autocast too, as the reference's
        return _fp8_reference(q, k, v, spec)


def _fp8_reference(q: Tensor, k: Tensor, v: Tensor, spec: Spec) -> Tensor:
    from lightning_gem.ops.attention.impl.reference import _buckets, _gather, _head_major, _probabilities

    ops = quantize_fp8(q, k, v, spec.kv_offsets)
    num_q, num_k = q.shape[0], k.shape[0]
    seg = jagged.segment_ids(spec.kv_offsets, num_k)
    q_deq = ops.q.float() * ops.q_scale.t()[:, :, None]
    k_deq = ops.k.float() * ops.k_scale.t()[:, :, None]
    v_deq = value_codes(ops, spec.kv_offsets) * ops.v_scale[seg]
    q_norm = torch.linalg.vector_norm(ops.q.float(), dim=2) * ops.q_scale.t()  # [Tq, H]
    kv_seg = torch.arange(spec.q_offsets.shape[0] - 1, device=q.device) if spec.kv_index is None else spec.kv_index
    q_kv_seg = kv_seg.to(torch.int64)[jagged.segment_ids(spec.q_offsets, num_q)]
    bound = pointwise_bound(q_norm, ops.k_norm[q_kv_seg], spec.scale)  # [Tq, H]

    out = q.new_zeros(num_q, q.shape[1], v.shape[2], dtype=torch.float32)
    q_h, k_h, v_h, bound_h = _head_major(q_deq), _head_major(k_deq), _head_major(v_deq), bound.t().contiguous()
    rows, values = [], []
    for b in _buckets(num_q, num_k, spec):
        qb = _gather(q_h, b.q_idx, torch.float32)
        kb, vb = _gather(k_h, b.k_idx, torch.float32), _gather(v_h, b.k_idx, torch.float32)
        scores = torch.matmul(qb, kb.transpose(-1, -2)) * spec.scale  # [H, N, Lq, Lk]
        if spec.activation == "softmax":
            masked = scores.masked_fill(~b.mask, float("-inf"))
            row_max = masked.amax(dim=-1, keepdim=True)
            row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
            weights = torch.exp(masked - row_max)
            denom = weights.sum(dim=-1, keepdim=True)
            codes = (weights * P_SCALE).to(E4M3).float() / P_SCALE
            ob = torch.matmul(codes, vb) / torch.where(denom > 0, denom, torch.ones_like(denom))
        else:
            row_bound = bound_h.index_select(1, b.q_idx.reshape(-1)).view(bound_h.shape[0], *b.q_idx.shape, 1)
            act = _probabilities(scores, b.mask, spec.activation)
            codes = (act * (P_SCALE / row_bound)).to(E4M3).float()
            ob = torch.matmul(codes, vb) * (row_bound / P_SCALE) / b.len_k
        rows.append(b.q_idx[b.q_valid])
        values.append(ob.permute(1, 2, 0, 3)[b.q_valid])
    if rows:
        out = out.index_put((torch.cat(rows),), torch.cat(values))
    return out.to(q.dtype)
