"""``impl="auto"``'s PyTorch FlashAttention-2 candidate (:mod:`lightning_gem.ops.attention.impl.varlen`).

On CPU: which calls it is offered, and how GDPA's modes become FlashAttention-2's arguments. PyTorch's two flash
ops are replaced by an emulation of their documented contract (per varlen segment, query ``i`` sees keys
``[i + Lk - Lq - left, i + Lk - Lq + right]``, -1 unbounded, ``right = 0`` when causal; natural-log log-sum-exp,
``+inf`` and a zero row where nothing is seen; the backward recomputes the probabilities from the log-sum-exp it is
handed), and the tuner is made to pick it for the forward, the backward or both, beside the Triton kernels under
the interpreter and a FlashAttention-4 stand-in: every mix must give the float64 reference's output and gradients.
On a GPU: the real kernels against the float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_gem.ops.attention.impl import flash, varlen
from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.jagged_inputs import make_gdpa_inputs
from lightning_gem.testing.numerics import assert_within_budget


def _spec(offsets: torch.Tensor, **options) -> Spec:
    fields = dict(activation="softmax", causal=True, window=None, block_size=None, scale=0.25)
    return Spec(offsets, offsets, None, None, **{**fields, **options})


def test_window_keywords() -> None:
    offsets = torch.tensor([0, 4])
    assert varlen._window(_spec(offsets)) == dict(window_size_left=-1, window_size_right=0)
    assert varlen._window(_spec(offsets, window=5)) == dict(window_size_left=5, window_size_right=0)
    assert varlen._window(_spec(offsets, causal=False, window=5)) == dict(window_size_left=5, window_size_right=5)
    assert varlen._window(_spec(offsets, causal=False)) == dict(window_size_left=-1, window_size_right=-1)


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(activation="silu"), "`activation='silu'`"),
        (dict(num_targets=torch.tensor([1])), "`num_targets`"),
        (dict(kv_index=torch.tensor([0])), "`kv_index`"),
        ({}, "`q` on cpu"),
    ],
)
def test_unsupported_names_the_argument(change: dict, named: str) -> None:
    q = v = torch.randn(4, 2, 16, dtype=torch.bfloat16)
    reason = varlen.varlen_unsupported(q, v, _spec(torch.tensor([0, 4]))._replace(**change))
    assert reason is not None and reason.startswith(named), reason


@pytest.mark.parametrize(
    ("dims", "capability", "named"),
    [
        ((64, 64), (9, 0), None),
        ((256, 256), (8, 0), None),
        ((64, 32), (9, 0), "head dims (64, 32)"),
        ((72, 72), (9, 0), None),
        ((60, 60), (9, 0), "head dims (60, 60)"),
        ((320, 320), (9, 0), "head dims (320, 320)"),
        ((64, 64), (7, 5), "`q` on a GPU of compute capability 7.x"),
    ],
)
def test_unsupported_gpu_rules(monkeypatch: pytest.MonkeyPatch, dims: tuple, capability: tuple, named) -> None:
    """The GPU and head-dim rules, with the device's answers made up (this test runs on CPU)."""
    monkeypatch.setattr(varlen, "mode_unsupported", lambda *args, **kwargs: None)
    monkeypatch.setattr(varlen, "device_capability", lambda device: capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    q, v = torch.randn(4, 2, dims[0]), torch.randn(4, 2, dims[1])
    reason = varlen.varlen_unsupported(q, v, _spec(torch.tensor([0, 4])))
    assert reason == named if named is None else reason.startswith(named), reason
    if capability[0] >= 8:
        monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: False)
        reason = varlen.varlen_unsupported(q, v, _spec(torch.tensor([0, 4])))
        assert reason is not None and "without PyTorch's FlashAttention-2" in reason


# ----------------------------------------------------------------------------------------------------------------------
# The translation of GDPA's modes, through an emulation of the two flash ops


def _allowed(length_q: int, length_k: int, left: int, right: int, device: torch.device) -> torch.Tensor:
    """FlashAttention's documented mask: query i sees keys [i + Lk - Lq - left, i + Lk - Lq + right]."""
    i = torch.arange(length_q, device=device)[:, None] + length_k - length_q
    j = torch.arange(length_k, device=device)[None, :]
    lower = torch.full_like(i, -(2**40)) if left < 0 else i - left
    upper = torch.full_like(i, 2**40) if right < 0 else i + right
    return (j >= lower) & (j <= upper)


def _segments(cu_q: torch.Tensor, cu_k: torch.Tensor):
    assert cu_q.dtype == cu_k.dtype == torch.int32  # FlashAttention's cumulative lengths
    for b in range(cu_q.numel() - 1):
        yield slice(int(cu_q[b]), int(cu_q[b + 1])), slice(int(cu_k[b]), int(cu_k[b + 1]))


def _emulated_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, return_debug_mask, *, scale,
                      window_size_left, window_size_right):  # fmt: skip
    assert type(max_q) is int and type(max_k) is int and dropout_p == 0.0 and not return_debug_mask
    right = 0 if is_causal else window_size_right
    out = torch.zeros_like(q)
    lse = torch.full((q.shape[1], q.shape[0]), float("inf"), dtype=torch.float32)
    for rows, keys in _segments(cu_q, cu_k):
        assert rows.stop - rows.start <= max_q and keys.stop - keys.start <= max_k
        allowed = _allowed(rows.stop - rows.start, keys.stop - keys.start, window_size_left, right, q.device)
        scores = torch.einsum("ihd,jhd->hij", q[rows].float(), k[keys].float()) * scale
        scores = scores.masked_fill(~allowed, float("-inf"))
        row_lse = torch.logsumexp(scores, dim=-1)  # -inf where nothing is seen
        probs = torch.exp(scores - row_lse[..., None]).nan_to_num(0.0)
        out[rows] = torch.einsum("hij,jhd->ihd", probs, v[keys].float()).to(q.dtype)
        lse[:, rows] = row_lse.where(row_lse > float("-inf"), float("inf"))
    return out, lse, torch.empty(2, dtype=torch.uint64), torch.empty(0), torch.empty(0)


def _emulated_backward(grad_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout_p, is_causal, rng_state,
                       unused, *, scale, window_size_left, window_size_right):  # fmt: skip
    assert grad_out.is_contiguous() and lse.dtype == torch.float32 and not torch.isneginf(lse).any()
    right = 0 if is_causal else window_size_right
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for rows, keys in _segments(cu_q, cu_k):
        allowed = _allowed(rows.stop - rows.start, keys.stop - keys.start, window_size_left, right, q.device)
        scores = torch.einsum("ihd,jhd->hij", q[rows].float(), k[keys].float()) * scale
        probs = torch.exp(scores - lse[:, rows, None]).masked_fill(~allowed, 0.0)  # from the lse handed in
        d_out = grad_out[rows].float()
        dv[keys] = torch.einsum("hij,ihd->jhd", probs, d_out).to(v.dtype)
        d_probs = torch.einsum("ihd,jhd->hij", d_out, v[keys].float())
        delta = (d_out * out[rows].float()).sum(-1).transpose(0, 1)[..., None]
        d_scores = probs * (d_probs - delta) * scale
        dq[rows] = torch.einsum("hij,jhd->ihd", d_scores, k[keys].float()).to(q.dtype)
        dk[keys] = torch.einsum("hij,ihd->jhd", d_scores, q[rows].float()).to(k.dtype)
    return dq, dk, dv


@pytest.fixture
def auto_with_emulation(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``impl="auto"`` with both library candidates offered: FlashAttention-2 through the emulated ops, FA4 through a
    stand-in (the Triton kernels, FA4's log-sum-exp conventions: natural log, -inf where nothing is seen); the
    tuner picks, per phase, the candidate the returned dict's ``"fwd"`` / ``"bwd"`` name (a Triton tile if None)."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_gem.ops.attention.impl.triton import _tuning, backward, forward

    if not isinstance(forward._gdpa_fwd_kernel, InterpretedFunction):
        pytest.skip("the plumbing test runs the Triton kernels under the interpreter")
    ran: list[str] = []
    picks: dict = {"fwd": None, "bwd": None, "ran": ran}
    tiles = _tuning.Tiles(16, 16, 1, 1)

    def aten_forward(*args, **kwargs):
        ran.append("varlen fwd")
        return _emulated_forward(*args, **kwargs)

    def aten_backward(*args, **kwargs):
        ran.append("varlen bwd")
        return _emulated_backward(*args, **kwargs)

    def fa4_forward(q, k, v, spec, need_lse=True, natural_lse=False):
        ran.append("flash fwd")
        out, lse = forward.gdpa_forward(q, k, v, spec, tiles=tiles, need_lse=need_lse)
        if natural_lse:
            lse = (lse * math.log(2.0)).nan_to_num(posinf=float("-inf"))
        return out, lse

    def pick(registry, key, candidates, run, tensors, *, timings=None, **options):
        wanted = picks[key[0]]
        choice = wanted if wanted in candidates else next(c for c in candidates if c not in _tuning.LIBRARIES)
        timings.update({c: 0.5 if c == choice else 1.0 for c in candidates})
        registry[key] = choice
        return choice

    monkeypatch.setattr(torch.ops.aten, "_flash_attention_forward", aten_forward, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_flash_attention_backward", aten_backward, raising=False)
    monkeypatch.setattr(flash, "flash_forward", fa4_forward)
    libraries = lambda *args: [_tuning.FLASH, _tuning.VARLEN]
    monkeypatch.setattr(forward, "library_candidates", libraries)
    monkeypatch.setattr(backward, "library_candidates", libraries)
    monkeypatch.setattr(_tuning, "pick_fastest", pick)
    _tuning.forget_choices()
    yield picks
    _tuning.forget_choices()


MODES = [
    ("self", dict(causal=True)),
    ("self", dict(causal=False)),
    ("self", dict(causal=True, window=5)),
    ("self", dict(causal=False, window=3)),
    ("self", dict(causal=False, block_size=8)),
    ("self", dict(causal=True, block_size=5)),
    ("cross", dict(causal=False)),
    ("cross", dict(causal=True)),
    ("cross", dict(causal=True, window=4)),
]
PHASES = [("varlen", "varlen"), ("varlen", None), (None, "varlen"), ("flash", "varlen")]


@pytest.mark.parametrize(("layout", "mode"), MODES)
@pytest.mark.parametrize("phases", PHASES, ids=lambda p: f"{p[0]}-{p[1]}")
def test_auto_runs_varlen_exactly(auto_with_emulation: dict, layout: str, mode: dict, phases: tuple) -> None:
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    auto_with_emulation["fwd"], auto_with_emulation["bwd"] = phases
    generator = torch.Generator().manual_seed(11)
    # Empty and one-token segments; kv segments longer and shorter than their query segments (cross).
    inputs = make_gdpa_inputs(layout, generator, q_lengths=[13, 0, 1, 9, 20], kv_lengths=[7, 4, 0, 17, 20], heads=2,
                              dim=16, dim_v=16, dtype=torch.float32)  # fmt: skip
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    options = {**dict(activation="softmax", window=None, block_size=None, scale=0.3), **mode}
    spec = Spec(inputs.q_offsets, kv_offsets, None, None, **options)
    leaves = [t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    out = gdpa_triton(*leaves, spec, flash=True)
    grad_out = torch.randn(out.shape, generator=generator)
    grads = torch.autograd.grad(out, leaves, grad_out)
    ran = auto_with_emulation["ran"]
    assert ("varlen fwd" in ran) == (phases[0] == "varlen") and ("flash fwd" in ran) == (phases[0] == "flash")
    assert ("varlen bwd" in ran) == (phases[1] == "varlen")
    f64 = [t.double() for t in (inputs.q, inputs.k, inputs.v)]
    oracle = [gdpa_reference(*f64, spec), *gdpa_reference_backward(grad_out.double(), *f64, spec)]
    same = [gdpa_reference(inputs.q, inputs.k, inputs.v, spec)]
    same += gdpa_reference_backward(grad_out, inputs.q, inputs.k, inputs.v, spec)
    for name, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
        assert torch.isfinite(got).all(), name
        assert_within_budget(got, exact, ref, name=name)


def test_auto_logs_each_library(auto_with_emulation: dict, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from lightning_gem.ops.attention.impl.triton import _tuning, gdpa_triton

    auto_with_emulation["fwd"] = "varlen"
    offsets = torch.tensor([0, 20, 33])
    q, k, v = (torch.randn(33, 2, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    with caplog.at_level(logging.INFO, logger=_tuning.__name__), torch.no_grad():
        gdpa_triton(q, k, v, _spec(offsets), flash=True)
    (line,) = [message for message in caplog.messages if "GDPA impl='auto' fwd" in message]
    assert "PyTorch FlashAttention-2 (0.500 ms)" in line and "FlashAttention-4 1.000 ms" in line, line
    # the key without library kernels (a traced call's) keeps the best Triton tiles
    chosen = _tuning.chosen_tiles()
    triton_keys = [key for key in chosen if key[0] == "fwd" and key[-1] is False]
    assert triton_keys and all(chosen[key] not in _tuning.LIBRARIES for key in triton_keys)


# ----------------------------------------------------------------------------------------------------------------------
# The real kernels (CUDA)


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "mode"), MODES)
@pytest.mark.parametrize("phases", PHASES[:3], ids=lambda p: f"{p[0]}-{p[1]}")
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_varlen_matches_reference_gpu(
    monkeypatch: pytest.MonkeyPatch, layout: str, mode: dict, phases: tuple, dim: int
) -> None:
    if not torch.cuda.is_available():
        pytest.skip("PyTorch's FlashAttention-2 needs a CUDA GPU")
    from lightning_gem.ops.attention.impl.triton import _tuning, gdpa_triton

    q = torch.empty(1, 1, dim, device="cuda", dtype=torch.bfloat16)
    reason = varlen.varlen_unsupported(q, q, _spec(torch.tensor([0, 1], device="cuda")))
    if reason is not None:
        pytest.skip(reason)
    picks = dict(zip(("fwd", "bwd"), phases, strict=True))

    def pick(registry, key, candidates, run, tensors, *, timings=None, **options):
        wanted = picks[key[0]]
        choice = wanted if wanted in candidates else next(c for c in candidates if c not in _tuning.LIBRARIES)
        timings[choice] = 1.0
        registry[key] = choice
        return choice

    monkeypatch.setattr(_tuning, "pick_fastest", pick)
    _tuning.forget_choices()
    generator = torch.Generator().manual_seed(dim)
    inputs = make_gdpa_inputs(layout, generator, q_lengths=[300, 0, 1, 129, 77], kv_lengths=[200, 5, 0, 250, 77],
                              max_len=400, heads=3, dim=dim, dim_v=dim, dtype=torch.bfloat16)  # fmt: skip
    cuda = {n: t.cuda() for n, t in vars(inputs).items() if isinstance(t, torch.Tensor)}
    q, k, v = cuda["q"], cuda["k"], cuda["v"]
    kv_offsets = cuda.get("kv_offsets", cuda["q_offsets"])
    options = {**dict(activation="softmax", window=None, block_size=None, scale=1 / math.sqrt(dim)), **mode}
    if options["block_size"] is not None:
        options["block_size"] *= 8
    spec = Spec(cuda["q_offsets"], kv_offsets, None, None, **options)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = gdpa_triton(*leaves, spec, flash=True)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    chosen = {key[0]: c for key, c in _tuning.chosen_tiles().items() if key[-1] is True}
    assert (chosen["fwd"] == _tuning.VARLEN) == (phases[0] == "varlen")
    assert (chosen["bwd"] == _tuning.VARLEN) == (phases[1] == "varlen")
    _tuning.forget_choices()
    f64 = [t.double() for t in (q, k, v)]
    oracle = [gdpa_reference(*f64, spec), *gdpa_reference_backward(grad_out.double(), *f64, spec)]
    same = [gdpa_reference(q, k, v, spec, compute_dtype=torch.bfloat16)]
    same += gdpa_reference_backward(grad_out, q, k, v, spec, compute_dtype=torch.bfloat16)
    for name, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
        assert torch.isfinite(got).all(), name
        assert_within_budget(got, exact, ref, name=f"{phases} {name}", ulps=2.0)
