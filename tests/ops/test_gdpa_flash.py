"""GDPA's FlashAttention-4 backend and ``impl="auto"``'s choice among backends.

On CPU: which modes FA4 is handed (and the message for the others), the block segments it gets for
BlockAttention, the errors of ``impl="flash"``, the tuner's key (heads and work), and the plumbing of ``auto``
when the tuner picks FlashAttention-4 for the forward or the backward (a stand-in computes what FA4 would, through
the Triton kernels under the interpreter). On a GPU with FA4 installed: FA4 itself against the float64 reference.
"""

from __future__ import annotations

import logging
import math

import pytest
import torch

import lightning_gem.imports
from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.impl import flash
from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.jagged_inputs import lengths_to_offsets, make_gdpa_inputs
from lightning_gem.testing.numerics import assert_within_budget


def _qkv(rows: int, dtype: torch.dtype = torch.bfloat16, heads: int = 2, dim: int = 16) -> list[torch.Tensor]:
    return [torch.randn(rows, heads, dim, dtype=dtype) for _ in range(3)]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (dict(activation="silu"), "`activation='silu'`"),
        (dict(num_targets=torch.tensor([1, 0])), "`num_targets`"),
        (dict(kv_index=torch.tensor([0, 0])), "`kv_index`"),
        (dict(block_size=4, self_attention=False), "`block_size` with cross-attention"),
        (dict(dtype=torch.float32), "`q` of dtype torch.float32"),
        ({}, "`q` on cpu"),
    ],
)
def test_unsupported_names_the_argument(change: dict, named: str) -> None:
    q, _, v = _qkv(5, change.pop("dtype", torch.bfloat16))
    options = dict(activation="softmax", block_size=None, kv_index=None, num_targets=None, self_attention=True)
    reason = flash.unsupported(q, v, **{**options, **change})
    assert reason is not None and reason.startswith(named), reason


def test_impl_flash_refuses_what_fa4_does_not_compute() -> None:
    q, k, v = _qkv(7)
    offsets = torch.tensor([0, 3, 7])
    with pytest.raises(ValueError, match=r"impl='flash' cannot compute `activation='silu'`"):
        gdpa(q, k, v, offsets, activation="silu", causal=True, impl="flash")
    with pytest.raises(ValueError, match=r"impl='flash' cannot compute `num_targets`"):
        gdpa(q, k, v, offsets, num_targets=torch.tensor([1, 1]), impl="flash")


def test_require_flash_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    missing = lightning_gem.imports.RequirementCache("lightning-gem-no-such-package==1.0")
    monkeypatch.setattr(flash, "FA4_AVAILABLE", missing)
    with pytest.raises(ModuleNotFoundError, match=r"pip install 'lightning-gem\[fa4\]'"):
        flash.require_flash()


@pytest.mark.parametrize("block_size", [1, 4, 7, 64])
def test_block_offsets(block_size: int) -> None:
    lengths = [0, 9, 1, 16, 0, 23, 5]
    offsets = lengths_to_offsets(lengths)
    total = sum(lengths)
    got = flash.block_offsets(offsets, block_size, total)
    assert got.dtype == torch.int32
    assert got.numel() == total // block_size + len(lengths) + 1  # the bound, padded with empty segments
    expected = []
    for start, length in zip(offsets.tolist(), lengths, strict=False):
        expected += list(range(start, start + length, block_size))
    padded = expected + [total] * (got.numel() - len(expected))
    assert got.tolist() == padded


def test_varlen_arguments_made_once_per_offsets() -> None:
    """The int32 offsets and block offsets FA4 takes are made once per offsets tensor (every layer's forward and
    backward reuse them), again after the offsets change in place, and int32 offsets are passed through."""
    offsets = lengths_to_offsets([5, 0, 12, 3])
    spec = Spec(offsets, offsets, None, None, "softmax", True, None, None, 0.5, 12, 12)
    first = flash.varlen_arguments(spec, 20)
    again = flash.varlen_arguments(spec, 20)
    assert first["cu_seqlens_q"] is again["cu_seqlens_q"] is again["cu_seqlens_k"]
    assert first["cu_seqlens_q"].dtype == torch.int32 and first["cu_seqlens_q"].tolist() == offsets.tolist()
    assert (first["max_seqlen_q"], first["max_seqlen_k"]) == (12, 12)
    offsets[2] = 4  # in place: the version moves, the int32 copy is made again
    changed = flash.varlen_arguments(spec, 20)["cu_seqlens_q"]
    assert changed is not first["cu_seqlens_q"] and changed.tolist() == offsets.tolist()
    as_int32 = offsets.to(torch.int32)
    assert (
        flash.varlen_arguments(spec._replace(q_offsets=as_int32, kv_offsets=as_int32), 20)["cu_seqlens_q"] is as_int32
    )
    blocks = flash.varlen_arguments(spec._replace(block_size=4, max_seq_len_q=12), 20)
    assert (
        blocks["cu_seqlens_q"]
        is flash.varlen_arguments(spec._replace(block_size=4, max_seq_len_q=12), 20)["cu_seqlens_k"]
    )
    assert blocks["cu_seqlens_q"].tolist() == flash.block_offsets(offsets, 4, 20).tolist()
    assert blocks["max_seqlen_q"] == 4
    assert flash.varlen_arguments(spec._replace(block_size=8), 20)["cu_seqlens_q"] is not blocks["cu_seqlens_q"]


def test_window_keywords() -> None:
    assert flash._window(True, None) == dict(window_size_left=None, window_size_right=None)
    assert flash._window(True, 5) == dict(window_size_left=5, window_size_right=None)  # FA4 sets right = 0
    assert flash._window(False, 5) == dict(window_size_left=5, window_size_right=5)


def test_work_bucket() -> None:
    from lightning_gem.ops.attention.impl.triton._tuning import work_bucket

    assert work_bucket(1024, 4, 1024, 4) == (1024 * 4 * 256).bit_length()
    assert work_bucket(1024, 4, 1024, 4) != work_bucket(1024, 8, 1024, 4)  # twice the heads, the next bucket
    assert work_bucket(1000, 4, 1000, 4) == work_bucket(1024, 4, 1024, 4) - 1
    assert work_bucket(0, 4, 0, 0) == 0
    assert work_bucket(3.0, 4, 8, 1) is None  # not an int: no bucket


def _triton_device() -> str:
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_gem.ops.attention.impl.triton import forward

    if isinstance(forward._gdpa_fwd_kernel, InterpretedFunction):
        return "cpu"
    pytest.skip("the auto plumbing test runs the kernels under the interpreter")


@pytest.fixture
def auto_with_stand_in(monkeypatch: pytest.MonkeyPatch) -> dict:
    """``impl="auto"`` as if FlashAttention-4 were a candidate, with a stand-in for FA4 (the Triton kernels with a
    fixed tile shape, whose output and log-sum-exp follow the same conventions), and a tuner that picks FA4 for
    the phases listed in the returned dict's ``"flash"`` (timings made up: FA4 0.5 ms, each Triton tile 1 ms)."""
    from lightning_gem.ops.attention.impl.triton import _tuning, backward, forward

    device = _triton_device()
    calls = {"flash": set(), "ran": [], "need_lse": [], "natural_lse": []}

    def stand_in_forward(q, k, v, spec, need_lse=True, natural_lse=False):
        calls["ran"].append("flash fwd")
        calls["need_lse"].append(need_lse)
        calls["natural_lse"].append(natural_lse)
        out, lse = forward.gdpa_forward(q, k, v, spec, tiles=_tuning.Tiles(16, 16, 1, 1), need_lse=need_lse)
        if natural_lse:  # FA4's own: natural log, -inf where a row sees no key
            lse = (lse * math.log(2.0)).nan_to_num(posinf=float("-inf"))
        return out, lse

    def stand_in_backward(grad_out, q, k, v, out, lse, spec, natural_lse=False):
        calls["ran"].append("flash bwd" + (" natural lse" if natural_lse else ""))
        if natural_lse:
            lse = flash.lse_to_base2(lse)
        tiles = _tuning.Tiles(16, 16, 1, 1)
        return backward.gdpa_backward(grad_out, q, k, v, out, lse, spec, dkdv_tiles=tiles, dq_tiles=tiles)

    def pick(registry, key, candidates, run, tensors, *, timings=None, **options):
        timings.update({c: 0.5 if c == _tuning.FLASH else 1.0 for c in candidates})
        choice = _tuning.FLASH if key[0] in calls["flash"] and _tuning.FLASH in candidates else candidates[0]
        registry[key] = choice
        return choice

    monkeypatch.setattr(forward, "library_candidates", lambda *args: [_tuning.FLASH])
    monkeypatch.setattr(backward, "library_candidates", lambda *args: [_tuning.FLASH])
    monkeypatch.setattr(flash, "flash_forward", stand_in_forward)
    monkeypatch.setattr(flash, "flash_backward", stand_in_backward)
    monkeypatch.setattr(_tuning, "pick_fastest", pick)
    _tuning.forget_choices()
    calls["device"] = device
    yield calls
    _tuning.forget_choices()


@pytest.mark.parametrize("flash_phases", [("fwd",), ("bwd",), ("fwd", "bwd"), ()])
def test_auto_mixes_backends(auto_with_stand_in: dict, flash_phases: tuple, caplog: pytest.LogCaptureFixture) -> None:
    from lightning_gem.ops.attention.impl.triton import _tuning

    auto_with_stand_in["flash"] = set(flash_phases)
    generator = torch.Generator().manual_seed(3)
    inputs = make_gdpa_inputs(
        "self", generator, q_lengths=[37, 0, 1, 20], heads=2, dim=16, dim_v=16, dtype=torch.float32
    )
    leaves = [t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    options = dict(activation="softmax", causal=True, window=None, block_size=None, scale=0.25)
    with caplog.at_level(logging.INFO, logger=_tuning.__name__):
        out = gdpa(*leaves, inputs.q_offsets, impl="triton", **options)  # the path "auto" takes on CUDA
        # impl="triton" never offers FA4: nothing ran through the stand-in
        assert auto_with_stand_in["ran"] == []
        from lightning_gem.ops.attention.impl.triton import gdpa_triton

        out = gdpa_triton(*leaves, Spec(inputs.q_offsets, inputs.q_offsets, None, None, **options), flash=True)
        grad_out = torch.randn_like(out)
        grads = torch.autograd.grad(out, leaves, grad_out)
    # FA4's forward hands its own (natural-log) log-sum-exp on; FA4's backward takes it as it is, Triton's converted
    bwd = "flash bwd natural lse" if "fwd" in flash_phases else "flash bwd"
    expected = ["flash fwd"] * ("fwd" in flash_phases) + [bwd] * ("bwd" in flash_phases)
    assert auto_with_stand_in["ran"] == expected
    jagged = (inputs.q_offsets, inputs.q_offsets, None, None)
    f64 = [t.double() for t in (inputs.q, inputs.k, inputs.v)]
    spec = Spec(*jagged, **options)
    oracle = [gdpa_reference(*f64, spec)]
    oracle += gdpa_reference_backward(grad_out.double(), *f64, spec)
    same = [gdpa_reference(inputs.q, inputs.k, inputs.v, spec)]
    same += gdpa_reference_backward(grad_out, inputs.q, inputs.k, inputs.v, spec)
    for name, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
        assert_within_budget(got, exact, ref, name=name)
    # The auto keys (ending in True) hold the choice; the same keys ending in False hold the best Triton tiles.
    chosen = _tuning.chosen_tiles()
    for kernel in ("fwd", "bwd"):
        auto = [key for key in chosen if key[0] == kernel and key[-1] is True]
        assert len(auto) == 1
        assert (chosen[auto[0]] == _tuning.FLASH) == (kernel in flash_phases)
        assert chosen[(*auto[0][:-1], False)] != _tuning.FLASH
        # the measurements behind the choice are kept under the key that was timed
        assert _tuning.FLASH in _tuning.tuning_times()[auto[0]]
    assert sum("GDPA impl='auto'" in message for message in caplog.messages) == 2


def test_auto_keys_hold_heads(auto_with_stand_in: dict) -> None:
    from lightning_gem.ops.attention.impl.triton import _tuning, gdpa_triton

    offsets = torch.tensor([0, 20, 33])
    for heads in (2, 4):
        q, k, v = (torch.randn(33, heads, 16) for _ in range(3))
        gdpa_triton(q, k, v, Spec(offsets, offsets, None, None, "softmax", True, None, None, 0.25), flash=True)
    keys = [key for key in _tuning.chosen_tiles() if key[0] == "fwd" and key[-1] is True]
    assert len(keys) == 2 and {key[-4] for key in keys} == {2, 4}


def test_auto_inference_skips_the_log_sum_exp(auto_with_stand_in: dict) -> None:
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    auto_with_stand_in["flash"] = {"fwd"}
    offsets = torch.tensor([0, 20, 20, 33])
    q, k, v = (torch.randn(33, 2, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    spec = Spec(
        offsets, offsets, None, None, activation="softmax", causal=True, window=None, block_size=None, scale=0.25
    )
    with torch.no_grad():
        inference = gdpa_triton(q, k, v, spec, flash=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    training = gdpa_triton(*leaves, spec, flash=True)
    # FA4 is asked for the log-sum-exp only where a backward will read it; the outputs agree.
    assert auto_with_stand_in["need_lse"] == [False, True]
    torch.testing.assert_close(inference, training.detach(), rtol=0, atol=0)
    # The two calls tune keys of their own (FA4's cost differs), and both leave their best Triton tiles under the
    # one key a call without FA4 looks up; where the calls allow descriptor loads, their best pointer tile goes under
    # the key of a call without either (a traced one).
    from lightning_gem.ops.attention.impl.triton import _tuning, forward

    descriptors = forward.kv_descriptors_ok(q, k, v)
    forward_keys = [key for key in _tuning.chosen_tiles() if key[0] == "fwd"]
    timed = [key for key in forward_keys if key[6] == descriptors]
    assert sorted(key[-2:] for key in timed) == [(False, False), (False, True), (True, True)]
    traced = [key for key in forward_keys if key[6] != descriptors]
    assert [key[-2:] for key in traced] == ([(False, False)] if descriptors else [])


def test_flash_eager_calls_skip_the_ops_and_keep_the_natural_lse(
    auto_with_stand_in: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    """impl="flash" in plain eager training calls runs FA4's forward and backward through a Function of its own (no
    op dispatch), FA4's natural-log log-sum-exp handed on as it is; a traced call (here under FlopCounterMode) goes
    through the ops, in the kit's base-2 format. Both give the float64 reference's gradients."""
    from torch.utils.flop_counter import FlopCounterMode

    monkeypatch.setattr(flash, "unsupported", lambda *args, **kwargs: None)  # the stand-in runs on CPU
    monkeypatch.setattr(flash, "require_flash", lambda: None)
    offsets = torch.tensor([0, 20, 20, 33])
    q, k, v = (torch.randn(33, 2, 16, generator=torch.Generator().manual_seed(n)) for n in range(3))
    grad_out = torch.randn(33, 2, 16, generator=torch.Generator().manual_seed(3))
    options = dict(activation="softmax", causal=True, scale=0.25)
    spec = Spec(offsets, offsets, None, None, window=None, block_size=None, **options)
    f64 = [t.double() for t in (q, k, v)]
    expected = gdpa_reference_backward(grad_out.double(), *f64, spec)

    def grads() -> tuple:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = gdpa(*leaves, offsets, impl="flash", max_seq_len_q=20, max_seq_len_kv=20, **options)
        return torch.autograd.grad(out, leaves, grad_out)

    eager = grads()
    assert auto_with_stand_in["ran"] == ["flash fwd", "flash bwd natural lse"]
    assert auto_with_stand_in["natural_lse"] == [True]
    auto_with_stand_in["ran"].clear()
    with FlopCounterMode(display=False) as counter:
        traced = grads()
    assert auto_with_stand_in["ran"] == ["flash fwd", "flash bwd"]  # the ops' base-2 log-sum-exp
    assert counter.get_total_flops() > 0
    for got_eager, got_traced, want in zip(eager, traced, expected, strict=True):
        torch.testing.assert_close(got_eager.double(), want, rtol=0, atol=1e-5)
        torch.testing.assert_close(got_traced, got_eager, rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------------------------------
# FlashAttention-4 itself (GPU with FA4 installed)


def _fa4_device() -> str:
    if not torch.cuda.is_available():
        pytest.skip("FlashAttention-4 needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FlashAttention-4 runs on compute capability 9.x-11.x")
    if not lightning_gem.imports.FA4_AVAILABLE:
        pytest.skip(f"FlashAttention-4 is not installed ({lightning_gem.imports.FA4_AVAILABLE})")
    return "cuda"


FA4_MODES = [
    ("self", dict(causal=True)),
    ("self", dict(causal=False)),
    ("self", dict(causal=True, window=24)),
    ("self", dict(causal=False, block_size=64)),
    ("self", dict(causal=True, block_size=32)),
    ("cross", dict(causal=False)),
    ("cross", dict(causal=True)),
]


@pytest.mark.gpu
@pytest.mark.parametrize(("layout", "mode"), FA4_MODES)
@pytest.mark.parametrize("impl", ["flash", "auto"])
@pytest.mark.parametrize("dim", [64, 128, 256])
def test_flash_matches_reference_gpu(layout: str, mode: dict, impl: str, dim: int) -> None:
    _fa4_device()
    generator = torch.Generator().manual_seed(dim)
    inputs = make_gdpa_inputs(layout, generator, q_lengths=[300, 0, 1, 129, 77], max_len=400, heads=3, dim=dim,
                              dim_v=dim, dtype=torch.bfloat16)  # fmt: skip
    cuda = {n: t.cuda() for n, t in vars(inputs).items() if isinstance(t, torch.Tensor)}
    q, k, v = cuda["q"], cuda["k"], cuda["v"]
    kv_offsets = cuda.get("kv_offsets")
    options = dict(dict(activation="softmax", window=None, block_size=None, scale=1 / math.sqrt(dim)), **mode)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = gdpa(*leaves, cuda["q_offsets"], kv_offsets, impl=impl, **options)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, grad_out)
    jagged = (cuda["q_offsets"], cuda["q_offsets"] if kv_offsets is None else kv_offsets, None, None)
    f64 = [t.double() for t in (q, k, v)]
    spec = Spec(*jagged, **options)
    oracle = [gdpa_reference(*f64, spec)]
    oracle += gdpa_reference_backward(grad_out.double(), *f64, spec)
    same = [gdpa_reference(q, k, v, spec, compute_dtype=torch.bfloat16)]
    same += gdpa_reference_backward(grad_out, q, k, v, spec, compute_dtype=torch.bfloat16)
    for name, got, exact, ref in zip(("out", "dq", "dk", "dv"), [out, *grads], oracle, same, strict=True):
        assert_within_budget(got, exact, ref, name=f"{impl} {name}", ulps=2.0)


def _opcheck_flash_ops(device: str) -> None:
    """torch.library.opcheck of the forward and backward FA4 ops (schema: no undeclared mutation or aliasing; fake
    tensor registrations against the real outputs' shapes and dtypes), their arguments built from a Spec."""
    offsets = torch.tensor([0, 100, 100, 229], device=device)
    q, k, v = (torch.randn(229, 2, 64, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    spec = Spec(offsets, offsets, None, None, "softmax", True, None, None, 0.125, 129, 129)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(flash._gdpa_flash_op, (q, k, v, *spec), test_utils=checks)
    out, lse = flash._gdpa_flash_op(q, k, v, *spec)
    backward_args = (torch.randn_like(out), q, k, v, out, lse, *spec)
    torch.library.opcheck(flash._gdpa_flash_backward_op, backward_args, test_utils=checks)


def test_flash_ops_opcheck_with_stand_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ops' schemas and fake registrations on any machine: FA4's two entry points replaced by a stand-in module
    of the same signatures (outputs of FA4's shapes and dtypes), so a Spec field the schema misses fails here."""
    import sys
    import types

    def fwd(q, k, v, *, return_lse=True, **_):
        out = torch.randn(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype, device=q.device)
        lse = torch.randn(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device) if return_lse else None
        return out, lse

    def bwd(q, k, v, out, grad_out, lse, **_):
        return torch.randn_like(q), torch.randn_like(k), torch.randn_like(v)

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_fwd, interface._flash_attn_bwd = fwd, bwd
    for name in ("flash_attn", "flash_attn.cute"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", interface)
    _opcheck_flash_ops("cpu")


@pytest.mark.gpu
def test_flash_ops_opcheck_gpu() -> None:
    _fa4_device()
    _opcheck_flash_ops("cuda")
