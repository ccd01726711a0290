"""The public GDPA function: validation, defaults and ``impl=`` dispatch.

GDPA (generalized dot-product attention) is the one attention op of the kit. Jagged Flash Attention,
HSTU pointwise attention, target-aware candidate attention and BlockAttention are modes of it. The package
(:mod:`lightning_gem.ops.attention`) lists the public names.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_gem import jagged
from lightning_gem.ops._device import device_capability
from lightning_gem.ops.attention.impl.reference import ACTIVATIONS
from lightning_gem.ops.attention.spec import Spec

IMPLS = ("auto", "reference", "triton", "flash", "padded")


def gdpa(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor | None = None,
    *,
    kv_index: Tensor | None = None,
    activation: str = "softmax",
    causal: bool = False,
    window: int | None = None,
    block_size: int | None = None,
    num_targets: Tensor | None = None,
    scale: float | None = None,
    score_bias: Tensor | None = None,
    normalization_length: int | None = None,
    max_seq_len_q: int | None = None,
    max_seq_len_kv: int | None = None,
    impl: str = "auto",
    check_offsets: bool = True,
    deterministic: bool = False,
    precision: str | None = None,
) -> Tensor:
    r"""Generalized dot-product attention over jagged sequences.

    Legend: ``B`` query segments, ``Tq`` / ``Tk`` total query / key tokens, ``H`` heads, ``D`` q/k head
    dim, ``Dv`` value head dim. Segment ``b`` has queries ``q[q_offsets[b]:q_offsets[b+1]]`` (``Lq``
    of them) and attends to kv segment ``j = kv_index[b]`` (default ``j = b``), the keys
    ``k[kv_offsets[j]:kv_offsets[j+1]]`` (``Lk`` of them). Several query segments may share one kv
    segment (many candidates of a user over one history): nothing is copied.

    **Which pairs attend** (``i`` a query's index in its segment, ``t`` a key's):

    - Self-attention (``kv_offsets`` omitted, or equal lengths everywhere): ``h = Lk - num_targets[b]``
      history tokens followed by ``num_targets[b]`` targets; a query's position is ``p(i) = min(i, h)``.
      Cross-attention: no targets (``h = Lk``) and ``p(i) = i + Lk - Lq`` (bottom-right alignment, as
      FlashAttention's causal cross-attention).
    - ``(i, t)`` is allowed iff ``t == i >= h`` (a target sees itself) or ``t < h`` and every enabled
      rule holds: ``causal``: ``t <= p(i)``; ``window=w``: ``|p(i) - t| <= w``; ``block_size=s``:
      ``p(i) // s == t // s`` (BlockAttention, blocks aligned to the segment start: cost linear in
      length). So targets see the history and themselves, never each other; history never sees targets.

    **What is computed**, with ``s_it = scale * <q_i, k_t>`` (``scale`` defaults to ``1 / sqrt(D)``):

    - ``activation="softmax"``: ``o_i = sum_t softmax_t(s_it) v_t`` over allowed ``t``; a query with no
      allowed key (e.g. an empty kv segment) outputs zeros. Kernels keep an fp32 running max and
      log-sum-exp.
    - pointwise ``"silu" | "gelu" | "relu" | "sigmoid"`` (``gelu`` is the exact erf form):
      ``o_i = (1 / Lk) * sum_t act(s_it) v_t`` over allowed ``t``, where ``Lk`` is the length of the kv
      segment itself (history plus targets), never a batch maximum: a sample's output does not depend on
      its batch. An empty kv segment outputs zeros. ``normalization_length=N`` divides by ``N`` instead
      (the HSTU reference's ``1 / N`` over its padded length).
    - ``score_bias``: ``beta_it`` added to every score, ``act(s_it + beta_it)``, before the mask. It is a
      dense ``[B, H, L, L]`` tensor (or one that broadcasts to it, e.g. ``[L, L]`` for a bias of relative
      positions) over each segment's padded positions, so only the dense path takes it (see ``impl``).

    Output is ``[Tq, H, Dv]`` in q's dtype; accumulation is in fp32 (fp64 for fp64 inputs).

    Args:
        q: ``[Tq, H, D]`` queries. k: ``[Tk, H, D]`` keys. v: ``[Tk, H, Dv]`` values; same float dtype
            and device.
        q_offsets: ``[B + 1]`` int32/int64 offsets of the query segments.
        kv_offsets: ``[Bkv + 1]`` offsets of the kv segments; omitted: self-attention (``k``/``v`` share
            ``q_offsets``).
        kv_index: ``[B]`` int kv segment of each query segment, in ``[0, Bkv)``; omitted: ``B == Bkv``
            and segment ``b`` attends to kv segment ``b``.
        activation: ``"softmax"`` or a pointwise activation (above).
        causal: keys at positions after the query's are masked.
        window: max attention distance ``|p(i) - t|`` (``>= 0``), or None for unlimited.
        block_size: BlockAttention block length (``>= 1``), or None.
        num_targets: ``[B]`` int targets at the end of each self-attention segment, ``0 <= n <= L``.
        scale: score scale; default ``1 / sqrt(D)``.
        score_bias: a float tensor broadcasting to ``[B, H, L, L]`` added to the scores (in fp32), ``L`` the
            padded length (``max_seq_len_q``, or the longest segment); self-attention without targets only.
            Its gradient is computed. Only ``impl="padded"`` takes it (``"auto"`` resolves to it): memory and time
            grow with ``B L^2``, meant for short sequences (a few hundred tokens).
        normalization_length: pointwise activations only: divide by this fixed length (``>= 1``) instead of
            each kv segment's own length.
        max_seq_len_q, max_seq_len_kv: upper bounds on ``Lq`` / ``Lk`` (kernels use them as runtime
            hints to size grids without a device sync); checked when ``check_offsets``.
        impl: ``"reference"`` (pure PyTorch), ``"triton"`` (the kit's kernels: CUDA, or CPU under
            ``TRITON_INTERPRET=1``; fp16/bf16/fp32), ``"flash"`` (FlashAttention-4's varlen kernels, the optional
            ``[fa4]`` extra: plain softmax modes only, fp16/bf16 on sm_90+; no targets, no ``kv_index``, blocks
            only in self-attention), or ``"auto"``: on CUDA sm_80+ for fp16/bf16/fp32, the fastest of the Triton
            tile shapes and (where they compute the mode exactly and ``deterministic`` is off) FlashAttention-4, if
            installed, and PyTorch's own FlashAttention-2 (the kernels of ``varlen_attn``), timed on the first
            call of each key (mode, dtype, head dims, heads, length and work buckets; the forward and the backward
            each on its own) and logged at INFO level; under ``torch.compile`` the Triton kernels with the tiles
            timed in eager for the key, else a default shape; elsewhere the reference. ``"padded"``: the baseline
            a model without jagged kernels runs (padded ``[B, H, Lmax, D]`` tensors, a dense mask, SDPA or eager
            pointwise; memory ``B * Lmax**2``), kept to measure the kit against; with ``score_bias`` it is the
            dense path, scores in fp32 (einsum, masked softmax or pointwise weights) instead of SDPA. A named impl
            never falls back: it raises if it cannot run.
        check_offsets: validate offsets, indices and targets by reading their values (a device sync).
            Pass False only for offsets already validated upstream. Skipped under ``torch.compile``.
        deterministic: bitwise reproducible gradients. The Triton backward then computes dQ in a kernel of
            its own instead of adding it up with fp32 atomics (slower). The reference is deterministic anyway.
        precision: None (products in the inputs' dtype) or ``"fp8"``: the forward's two products on FP8 E4M3 codes
            with fp32 accumulation (:mod:`lightning_gem.ops.attention.fp8` says how q, k, v and the probabilities are
            scaled, and why none can overflow), and in the backward the two it recomputes, ``S`` and ``dP``, on codes
            with one scale per token and head; the three that make the gradients run in the inputs' dtype. The output
            and the gradients keep the inputs' dtypes. ``impl="triton"`` (CUDA sm_89+, or the interpreter) and
            ``"reference"`` (an exact emulation of the codes, any device) take it, and ``"auto"`` where it resolves
            to one of them; ``"flash"``, ``"padded"`` and ``score_bias`` do not.

    Returns:
        ``[Tq, H, Dv]`` attention output.

    Example:
        >>> import torch
        >>> from lightning_gem.ops import gdpa
        >>> offsets = torch.tensor([0, 3, 3, 7])  # lengths 3, 0, 4
        >>> q, k, v = (torch.randn(7, 2, 8) for _ in range(3))
        >>> gdpa(q, k, v, offsets, activation="silu", causal=True).shape
        torch.Size([7, 2, 8])
    """
    _check_qkv(q, k, v)
    # Reading offsets' values is a data-dependent branch that a compiled graph cannot hold.
    check_offsets = check_offsets and not torch.compiler.is_compiling()
    self_attention = kv_offsets is None
    if self_attention:
        if k.shape[0] != q.shape[0]:
            raise ValueError(
                f"`k` and `v` must have as many rows as `q` ({q.shape[0]}) for self-attention (no `kv_offsets`), "
                f"got {k.shape[0]}"
            )
        kv_offsets = q_offsets
        # One segmentation: either length hint serves both.
        max_seq_len_q = max_seq_len_kv if max_seq_len_q is None else max_seq_len_q
        max_seq_len_kv = max_seq_len_q if max_seq_len_kv is None else max_seq_len_kv
    num_segments = _check_offsets(q_offsets, "q_offsets", q, check_offsets)
    if self_attention:  # the same offsets over as many rows: checked once
        num_kv_segments = num_segments
    else:
        num_kv_segments = _check_offsets(kv_offsets, "kv_offsets", k, check_offsets)
    if kv_index is None:
        if num_kv_segments != num_segments:
            raise ValueError(
                f"`kv_offsets` must describe as many segments as `q_offsets` ({num_segments}) when `kv_index` is "
                f"omitted, got {num_kv_segments}"
            )
    else:
        _check_index(kv_index, "kv_index", num_segments, q.device)
        if check_offsets and kv_index.numel() and (int(kv_index.min()) < 0 or int(kv_index.max()) >= num_kv_segments):
            raise ValueError(f"`kv_index` entries must lie in [0, {num_kv_segments}) (the kv segments)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"`activation` must be one of {ACTIVATIONS}, got {activation!r}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"`window` must be a non-negative int or None, got {window!r}")
    if block_size is not None and (not isinstance(block_size, int) or block_size < 1):
        raise ValueError(f"`block_size` must be a positive int or None, got {block_size!r}")
    if num_targets is not None:
        _check_targets(num_targets, q_offsets, kv_offsets, kv_index, num_segments, q.device, check_offsets)
    if check_offsets:
        _check_hint(max_seq_len_q, q_offsets, "max_seq_len_q")
        _check_hint(max_seq_len_kv, kv_offsets, "max_seq_len_kv")
    if not isinstance(deterministic, bool):
        raise TypeError(f"`deterministic` must be a bool, got {type(deterministic).__name__}")
    if normalization_length is not None:
        _check_normalization_length(normalization_length, activation)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])

    if score_bias is None:
        resolved = resolve_impl(impl, q)
    else:
        resolved = _resolve_biased(impl, score_bias, q, self_attention, kv_index, num_targets, num_segments)
    if precision is not None:
        if score_bias is not None:
            raise ValueError("`precision='fp8'` cannot take `score_bias` (only the dense impl='padded' does)")
        _check_precision(precision, resolved, q, v)
    spec = Spec(q_offsets, kv_offsets, kv_index, num_targets, activation, causal, window, block_size, float(scale),
                max_seq_len_q, max_seq_len_kv, deterministic, precision)  # fmt: skip
    if resolved == "triton":  # the hot path first
        from lightning_gem.ops.attention.impl.triton import gdpa_triton

        out = gdpa_triton(q, k, v, spec, flash=impl == "auto")
    elif resolved == "padded":  # divides by normalization_length itself
        from lightning_gem.ops.attention.impl.padded import gdpa_padded

        return gdpa_padded(q, k, v, spec, score_bias=score_bias, normalization_length=normalization_length)
    elif resolved == "flash":
        from lightning_gem.ops.attention.impl.flash import gdpa_flash

        out = gdpa_flash(q, k, v, spec, self_attention=self_attention)
    elif precision == "fp8":
        from lightning_gem.ops.attention.fp8 import gdpa_fp8

        out = gdpa_fp8(q, k, v, spec)
    else:
        # Imported on first use: registering FLOP formulas imports torch.utils.flop_counter, which imports
        # Triton. FLOP counting that starts before the first call imports this module itself (lightning_gem.flops).
        from lightning_gem.ops.attention.ops import gdpa_reference_op

        out = gdpa_reference_op(q, k, v, *spec[:9])
    if normalization_length is not None:
        out = _renormalized(out, q_offsets, kv_offsets, kv_index, normalization_length)
    return out


def resolve_impl(impl: str, q: Tensor) -> str:
    """The implementation ``impl`` names for inputs like ``q``: ``"reference"``, ``"triton"``, ``"flash"`` or
    ``"padded"`` (``"auto"`` resolves to ``"triton"``, whose tuner may then pick FlashAttention-4, or the reference)."""
    if impl not in IMPLS:
        raise ValueError(f"`impl` must be one of {IMPLS}, got {impl!r}")
    if impl != "auto":
        return impl
    # Triton kernels need a CUDA device of compute capability 8.0+ and fp16/bf16/fp32 inputs.
    triton_dtype = q.dtype in (torch.float16, torch.bfloat16, torch.float32)
    if q.is_cuda and triton_dtype and device_capability(q.device) >= (8, 0):
        return "triton"
    return "reference"


def _resolve_biased(
    impl: str,
    score_bias: Tensor,
    q: Tensor,
    self_attention: bool,
    kv_index: Tensor | None,
    num_targets: Tensor | None,
    num_segments: int,
) -> str:
    """``"padded"``, the one implementation that takes ``score_bias``, after checking the bias and the mode."""
    if impl not in ("auto", "padded"):
        raise ValueError(f"`score_bias` needs impl='padded' (the dense path) or 'auto', got impl={impl!r}")
    if not self_attention or kv_index is not None or num_targets is not None:
        raise ValueError(
            "`score_bias` needs self-attention without targets: no `kv_offsets`, `kv_index` or `num_targets`"
        )
    jagged.check_floating(score_bias, "score_bias")
    jagged.check_device(score_bias, "score_bias", q.device)
    wanted = (num_segments, q.shape[1])[4 - score_bias.dim() :] if 2 <= score_bias.dim() <= 4 else None
    if wanted is None or any(n not in (1, w) for n, w in zip(score_bias.shape[:-2], wanted, strict=True)):
        raise ValueError(
            f"`score_bias` must broadcast to [B, H, L, L] = [{num_segments}, {q.shape[1]}, L, L], got shape "
            f"{tuple(score_bias.shape)}"
        )
    return "padded"


PRECISIONS = (None, "fp8")


def _check_precision(precision: str, resolved: str, q: Tensor, v: Tensor) -> None:
    """``precision="fp8"`` where the resolved implementation computes it: the reference anywhere, the Triton kernels
    on GPUs with FP8 tensor cores (sm_89+) or in the interpreter."""
    if precision not in PRECISIONS:
        raise ValueError(f"`precision` must be one of {PRECISIONS}, got {precision!r}")
    if resolved not in ("triton", "reference"):
        raise ValueError(f"`precision='fp8'` needs impl='triton', 'reference' or 'auto', got impl={resolved!r}")
    if resolved == "triton" and q.is_cuda and device_capability(q.device) < (8, 9):
        major, minor = device_capability(q.device)
        raise ValueError(
            f"`precision='fp8'` needs FP8 tensor cores (compute capability 8.9+), got {major}.{minor} on {q.device}"
        )
    if resolved == "triton" and q.is_cuda and min(q.shape[2], v.shape[2]) <= 16:
        raise ValueError(
            "`precision='fp8'` with impl='triton' needs head dims over 16 on a GPU (an FP8 tensor-core product sums "
            f"32 or more values), got q/k head dim {q.shape[2]} and v head dim {v.shape[2]}"
        )


def _check_normalization_length(normalization_length: int, activation: str) -> None:
    if isinstance(normalization_length, bool) or not isinstance(normalization_length, int) or normalization_length < 1:
        raise ValueError(f"`normalization_length` must be a positive int or None, got {normalization_length!r}")
    if activation == "softmax":
        raise ValueError("`normalization_length` divides pointwise attention; softmax takes none")


def _renormalized(
    out: Tensor, q_offsets: Tensor, kv_offsets: Tensor, kv_index: Tensor | None, normalization_length: int
) -> Tensor:
    """Pointwise ``out`` (divided by each kv segment's length) divided by ``normalization_length`` instead."""
    lengths = jagged.offsets_to_lengths(kv_offsets).to(out.dtype)
    if kv_index is not None:
        lengths = lengths[kv_index.to(torch.int64)]
    factor = lengths[jagged.segment_ids(q_offsets, out.shape[0])] / normalization_length
    return out * factor[:, None, None]


def jagged_flash_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, **kwargs) -> Tensor:
    """Jagged Flash Attention: causal softmax self-attention. Same arguments as :func:`gdpa`."""
    kwargs.setdefault("causal", True)
    return gdpa(q, k, v, offsets, activation="softmax", **kwargs)


def hstu_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, **kwargs) -> Tensor:
    """HSTU attention: causal pointwise SiLU self-attention normalised by each sequence's length.

    Same arguments as :func:`gdpa`; ``num_targets`` makes the last tokens of each sequence targets.
    """
    kwargs.setdefault("causal", True)
    kwargs.setdefault("activation", "silu")
    return gdpa(q, k, v, offsets, **kwargs)


def block_attention(q: Tensor, k: Tensor, v: Tensor, offsets: Tensor, *, block_size: int, **kwargs) -> Tensor:
    """BlockAttention: attention only inside fixed ``block_size`` blocks of each sequence (linear cost).

    Same arguments as :func:`gdpa`; softmax and bidirectional unless ``activation`` / ``causal`` say otherwise.
    """
    return gdpa(q, k, v, offsets, block_size=block_size, **kwargs)


def _check_qkv(q: Tensor, k: Tensor, v: Tensor) -> None:
    if _qkv_fit(q, k, v):  # the common case in one expression; otherwise find what is wrong and say it
        return
    for name, t in (("q", q), ("k", k), ("v", v)):
        jagged.check_floating(t, name)
        if t.dim() != 3:
            raise ValueError(f"`{name}` must be 3-D [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"`{name}` must have q's dtype {q.dtype}, got {t.dtype}")
        jagged.check_device(t, name, q.device)
        if t.shape[1] != q.shape[1]:
            raise ValueError(f"`{name}` must have q's {q.shape[1]} heads in dim 1, got {t.shape[1]}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"`k` must have q's head dim {q.shape[2]} in dim 2, got {k.shape[2]}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"`v` must have as many rows as `k` ({k.shape[0]}), got {v.shape[0]}")


def _qkv_fit(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether :func:`_check_qkv`'s rules all hold (its checks one by one cost several microseconds a call)."""
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return False
    dtype, device, (q_shape, k_shape, v_shape) = q.dtype, q.device, (q.shape, k.shape, v.shape)
    return (
        q.is_floating_point() and k.dtype == dtype and v.dtype == dtype and k.device == device
        and v.device == device and len(q_shape) == 3 and len(k_shape) == 3 and len(v_shape) == 3
        and k_shape[1] == q_shape[1] and v_shape[1] == q_shape[1] and k_shape[2] == q_shape[2]
        and v_shape[0] == k_shape[0]
    )  # fmt: skip


def _check_offsets(offsets: Tensor, name: str, values: Tensor, check_values: bool) -> int:
    jagged.validate_offsets(
        offsets,
        name,
        num_values=values.shape[0] if check_values else None,
        device=values.device,
        check_values=check_values,
    )
    return offsets.numel() - 1


def _check_index(index: Tensor, name: str, size: int, device: torch.device) -> None:
    if not isinstance(index, Tensor) or index.dtype not in jagged.INDEX_DTYPES:
        raise TypeError(f"`{name}` must be an int32/int64 tensor, got {getattr(index, 'dtype', type(index))}")
    if index.dim() != 1 or index.numel() != size:
        raise ValueError(f"`{name}` must have shape [{size}] (one entry per query segment), got {tuple(index.shape)}")
    jagged.check_device(index, name, device)


def _check_targets(
    num_targets: Tensor,
    q_offsets: Tensor,
    kv_offsets: Tensor,
    kv_index: Tensor | None,
    num_segments: int,
    device: torch.device,
    check_values: bool,
) -> None:
    _check_index(num_targets, "num_targets", num_segments, device)
    if not check_values:
        return
    len_q = q_offsets[1:] - q_offsets[:-1]
    len_k = kv_offsets[1:] - kv_offsets[:-1]
    if kv_index is not None:
        len_k = len_k[kv_index.to(torch.int64)]
    if not torch.equal(len_q.to(torch.int64), len_k.to(torch.int64)):
        raise ValueError("`num_targets` needs self-attention: every query segment must be as long as its kv segment")
    if num_targets.numel() and (bool((num_targets < 0).any()) or bool((num_targets > len_q).any())):
        raise ValueError("`num_targets` entries must lie in [0, segment length]")


def _check_hint(hint: int | None, offsets: Tensor, name: str) -> None:
    if hint is None:
        return
    longest = jagged.max_length(offsets)
    if hint < longest:
        raise ValueError(f"`{name}` ({hint}) must be >= the longest segment ({longest})")
