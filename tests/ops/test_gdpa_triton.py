"""GDPA Triton kernels against the reference, forward and backward, on random jagged batches.

On CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set by ``tests/conftest.py``
before Triton is imported); without it they need a CUDA GPU, and without either these tests skip.
Shapes stay small (the interpreter is slow): D=16, H=2, query lengths 37/0/1/16/23 (empty, length-1,
one block exactly, several blocks with a ragged tail at the 16x16 interpreter tiles), random kv lengths.
Results are judged against the float64 reference within the error budget of the same computation done
naively in the tested dtype (``lightning_gem.testing``'s padded oracle), not by a hand-tuned atol.
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import math
from collections.abc import Callable

import pytest
import torch

from lightning_gem.ops.attention.impl.reference import gdpa_reference, gdpa_reference_backward
from lightning_gem.ops.attention.spec import Spec
from lightning_gem.testing.gdpa_oracle import gdpa_oracle
from lightning_gem.testing.jagged_inputs import GDPAInputs, make_gdpa_inputs
from lightning_gem.testing.numerics import assert_within_budget

Q_LENGTHS = [37, 0, 1, 16, 23]
MAX_LEN = 40
# (causal, window, block_size)
MASKS = [
    (False, None, None),
    (True, None, None),
    (True, 5, None),
    (False, 7, None),
    (False, None, 8),
    (True, 6, 8),
]
LAYOUTS = ("self", "self_targets", "cross", "shared_kv")


if importlib.util.find_spec("triton") is not None:  # else the tests that need it skip
    import triton
    import triton.language as tl

    from lightning_gem.ops.attention.impl.triton._common import _program_ids

    @triton.jit
    def _order_kernel(OUT, ORDER, group, BY_LENGTH: tl.constexpr):
        """Adds each program's launch index (from 1) at the (pair, z) that ``_program_ids`` gives it."""
        a, head, z = _program_ids(group)
        if BY_LENGTH:  # as the kernels do: the order is read in the kernel's body
            a = tl.load(ORDER + a)
        heads, num_z = tl.num_programs(1), tl.num_programs(2)
        launched = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + heads * tl.program_id(2))
        tl.atomic_add(OUT + (a * heads + head) * num_z + z, launched + 1)


def _slow_beyond(values: list, quick: int, *, unpack: bool = False) -> list:
    """``values`` as parameters (each one tuple of several arguments with ``unpack``), those past the first
    ``quick`` marked ``slow``: the quick loop (``-m "not slow"``) keeps a representative few, the full suite runs
    them all."""
    params = [pytest.param(*v) if unpack else pytest.param(v) for v in values]
    return [p if i < quick else pytest.param(*p.values, marks=pytest.mark.slow) for i, p in enumerate(params)]


def _triton_device() -> str:
    """Where the kernels run in this process: ``cpu`` under the interpreter, else ``cuda``; skip if neither."""
    pytest.importorskip("triton")
    from triton.runtime.interpreter import InterpretedFunction

    from lightning_gem.ops.attention.impl.triton import forward

    if isinstance(forward._gdpa_fwd_kernel, InterpretedFunction):
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("GDPA Triton kernels need a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")


@pytest.fixture
def device() -> str:
    return _triton_device()


def _inputs(layout: str, seed: int, dtype: torch.dtype, device: str, **kwargs: object) -> GDPAInputs:
    generator = torch.Generator().manual_seed(seed)
    kwargs = {"q_lengths": Q_LENGTHS, "max_len": MAX_LEN, "heads": 2, "dim": 16, "dim_v": 16, **kwargs}
    inputs = make_gdpa_inputs(layout, generator, dtype=dtype, **kwargs)
    moved = {
        name: getattr(inputs, name) for name in ("q", "k", "v", "q_offsets", "kv_offsets", "kv_index", "num_targets")
    }
    moved = {name: None if t is None else t.to(device) for name, t in moved.items()}
    return GDPAInputs(**moved, q_lengths=inputs.q_lengths, kv_lengths=inputs.kv_lengths)


def _run_triton(inputs: GDPAInputs, grad_out: torch.Tensor | None = None, flash: bool = False, **options: object):
    """Output and (if ``grad_out``) ``(dq, dk, dv)`` of :func:`gdpa_triton` through autograd (``options``: the
    :class:`Spec` fields but the tensors)."""
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    q, k, v = (t.detach().clone().requires_grad_(grad_out is not None) for t in (inputs.q, inputs.k, inputs.v))
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    out = gdpa_triton(q, k, v, Spec(inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets, **options),
                      flash=flash)  # fmt: skip
    if grad_out is None:
        return out, None
    return out, torch.autograd.grad(out, (q, k, v), grad_out)


def _check_against_reference(
    inputs: GDPAInputs, options: dict, name: str, run: Callable | None = None, **kernel_options: object
) -> None:
    """Forward and gradients of the kernels vs the float64 reference, within the same-precision budget.
    ``run(grad_out)`` returns ``(out, (dq, dk, dv))`` (default: :func:`gdpa_triton` through autograd)."""
    dtype = inputs.q.dtype
    grad_out = torch.randn(inputs.q.shape[0], inputs.q.shape[1], inputs.v.shape[2], dtype=torch.float64)
    grad_out = grad_out.to(device=inputs.q.device, dtype=dtype)
    if run is None:
        out, grads = _run_triton(inputs, grad_out, **options, **kernel_options)
    else:
        out, grads = run(grad_out)

    cpu = {n: None if t is None else t.cpu() for n, t in vars(inputs).items() if isinstance(t, torch.Tensor | None)}
    q64, k64, v64 = (cpu[n].to(torch.float64) for n in ("q", "k", "v"))
    kv_offsets = cpu["q_offsets"] if cpu["kv_offsets"] is None else cpu["kv_offsets"]
    jagged = (cpu["q_offsets"], kv_offsets, cpu["kv_index"], cpu["num_targets"])
    oracle = gdpa_reference(q64, k64, v64, Spec(*jagged, **options))
    oracle_grads = gdpa_reference_backward(grad_out.cpu().to(torch.float64), q64, k64, v64, Spec(*jagged, **options))

    # The budget: the padded oracle run entirely in the tested dtype (fp16 on CPU, like every naive path).
    leaves = [cpu[n].to(dtype).requires_grad_() for n in ("q", "k", "v")]
    naive = gdpa_oracle(*leaves, cpu["q_offsets"], cpu["kv_offsets"], kv_index=cpu["kv_index"],
                        num_targets=cpu["num_targets"], dtype=dtype, **options)  # fmt: skip
    naive_grads = torch.autograd.grad(naive, leaves, grad_out.cpu(), allow_unused=True, materialize_grads=True)

    assert_within_budget(out.cpu(), oracle, naive, name=f"{name} out")
    for label, got, want, budget in zip(("dq", "dk", "dv"), grads, oracle_grads, naive_grads, strict=True):
        assert_within_budget(got.cpu(), want, budget, name=f"{name} {label}")


def _options(activation: str, causal: bool, window: int | None, block_size: int | None) -> dict:
    return {"activation": activation, "causal": causal, "window": window, "block_size": block_size,
            "scale": 1.0 / math.sqrt(16)}  # fmt: skip


@pytest.mark.parametrize("mask", _slow_beyond(MASKS, 2), ids=lambda m: f"causal{int(m[0])}-w{m[1]}-bs{m[2]}")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_fp32(device: str, layout: str, activation: str, mask: tuple) -> None:
    seed = 100 * LAYOUTS.index(layout) + 2 * MASKS.index(mask) + (activation == "silu")
    inputs = _inputs(layout, seed, torch.float32, device)
    _check_against_reference(inputs, _options(activation, *mask), f"{layout}/{activation}/{mask}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_fp16(device: str, layout: str, activation: str) -> None:
    inputs = _inputs(layout, 7, torch.float16, device)
    _check_against_reference(inputs, _options(activation, True, 9, 16), f"{layout}/{activation}")


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_whole_block_tiles(device: str, layout: str, activation: str) -> None:
    """BlockAttention with blocks that the interpreter's 16 x 16 tiles cover whole: unmasked inner tiles."""
    kv_lengths = {"cross": [40, 17, 33, 0, 29], "shared_kv": [40, 17, 33]}.get(layout)
    inputs = _inputs(layout, 31, torch.float32, device, kv_lengths=kv_lengths)
    _check_against_reference(inputs, _options(activation, activation == "silu", None, 16), f"{layout}/{activation}")


@pytest.mark.parametrize("causal", [False, True])
def test_softmax_scores_growing_along_keys(device: str, causal: bool) -> None:
    """Scores that grow along each segment's keys (exp of the score by up to 2^26 from one 16-key tile to the next):
    the forward's running max moves on later key tiles, and their rescale of what the earlier ones summed decides the
    output (random scores barely move it after the first tile); output and gradients (through the log-sum-exp) as the
    reference's."""
    inputs = _inputs("self", 11, torch.float32, device)
    ramp = torch.cat([torch.linspace(0.25, 6.0, int(n)) for n in inputs.q_lengths]).to(device)
    inputs = dataclasses.replace(inputs, q=inputs.q.abs(), k=inputs.k.abs() * ramp[:, None, None])
    _check_against_reference(inputs, _options("softmax", causal, None, None), f"growing/causal{int(causal)}")


@pytest.mark.parametrize("activation", ["gelu", "relu", "sigmoid"])
def test_other_activations(device: str, activation: str) -> None:
    inputs = _inputs("self_targets", 3, torch.float32, device)
    _check_against_reference(inputs, _options(activation, True, None, None), activation)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_matches_reference_bf16_gpu(layout: str) -> None:
    # bf16 arithmetic is wrong in Triton's interpreter: judged on GPUs only.
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    inputs = _inputs(layout, 11, torch.bfloat16, "cuda")
    _check_against_reference(inputs, _options("softmax", True, 9, 16), layout)


TILE_CASES = [
    # (block_m, block_n, mask options): unequal tiles, and tiles that windows / blocks cover whole (unmasked)
    (32, 16, (True, 13, 20)),
    (16, 32, (True, 13, 20)),
    (16, 32, (True, None, None)),
    (32, 16, (False, 40, None)),
    (32, 32, (False, None, 32)),
]


@pytest.mark.parametrize("plan", ["atomic_dq", "deterministic", "split_dkdv"])
@pytest.mark.parametrize(("block_m", "block_n", "mask"), _slow_beyond(TILE_CASES, 2, unpack=True))
def test_other_tile_shapes(device: str, block_m: int, block_n: int, mask: tuple, plan: str) -> None:
    """Key/query ranges with tiles of other and unequal sizes, through the launchers directly: the dK/dV kernel with
    atomic dQ (dK and dV in one program, or in programs of their own) and the one-launch deterministic kernel."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    inputs = _inputs("self_targets", 5, torch.float32, device, q_lengths=[45, 1, 0, 33, 96])
    options = _options("softmax", *mask)
    jagged = (inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets)
    tiles = Tiles(block_m, block_n, 4)
    deterministic = plan == "deterministic"
    spec = Spec(*jagged, **options, max_seq_len_q=96, max_seq_len_kv=96, deterministic=deterministic)
    out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles)
    grad_out = torch.randn_like(out)
    tiles_bwd = {"dkdv_tiles": tiles, "dq_tiles": Tiles(block_n, block_m, 4) if deterministic else None}
    if plan == "split_dkdv":
        tiles_bwd["split_dkdv"] = True
    grads = gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, **tiles_bwd)
    cpu64 = [t.cpu().double() for t in (inputs.q, inputs.k, inputs.v)]
    cpu_spec = Spec(*(None if t is None else t.cpu() for t in jagged), **options)
    torch.testing.assert_close(out.cpu().double(), gdpa_reference(*cpu64, cpu_spec), rtol=0, atol=1e-5)
    expected = gdpa_reference_backward(grad_out.cpu().double(), *cpu64, cpu_spec)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-5)


def _launched_case(
    layout: str,
    seed: int,
    activation: str,
    device: str,
    *,
    one_launch: bool,
    split: bool = False,
    halves: bool = False,
    dv_stages: int = 0,
    dim: int = 16,
) -> tuple[GDPAInputs, dict, Callable]:
    """Inputs of ``layout``, the options of ``activation`` under a causal window, and a ``run(grad_out)`` for
    :func:`_check_against_reference` that calls the launchers directly with fixed tiles: the forward, then the dK/dV
    kernel with atomic dQ or (``one_launch``) the one-launch kernel, dK and dV in programs of their own with
    ``split`` (the dK one in column halves with ``halves``, the dV ones in a launch of their own with
    ``dv_stages``); ``dim`` the head dim of q, k and v."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    inputs = _inputs(layout, seed, torch.float32, device, dim=dim, dim_v=dim)
    options = _options(activation, True, 9, None)
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    tiles = Tiles(16, 16, 1, 1) if device == "cpu" else Tiles(32, 32, 4, 2)
    spec = Spec(inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets, **options,
                max_seq_len_q=max(inputs.q_lengths), max_seq_len_kv=max(inputs.kv_lengths))  # fmt: skip

    def run(grad_out: torch.Tensor) -> tuple:
        out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles)
        return out, gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, dkdv_tiles=tiles,
                                  dq_tiles=tiles if one_launch else None, split_dkdv=split,
                                  column_halves=halves, dv_stages=dv_stages)  # fmt: skip

    return inputs, options, run


@pytest.mark.parametrize(
    "one_launch, halves, dv_stages", [(False, False, 0), (False, True, 0), (False, True, 2), (True, False, 0)]
)
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", _slow_beyond(list(LAYOUTS), 2))
def test_split_dkdv_programs(
    device: str, layout: str, activation: str, one_launch: bool, halves: bool, dv_stages: int
) -> None:
    """dK and dV in programs of their own, the dK one adding dQ (``halves``: K, dK and dQ in two column halves;
    ``dv_stages``: the dV programs in a launch of their own) or (``one_launch``) beside dQ programs of the same
    launch: every layout (targets, shared and cross kv segments) and both activation families, under a causal
    window, against the float64 reference."""
    inputs, options, run = _launched_case(layout, 41, activation, device, one_launch=one_launch, split=True,
                                          halves=halves, dv_stages=dv_stages)  # fmt: skip
    label = f"{layout}/{activation}/split/{one_launch}/{halves}/{dv_stages}"
    _check_against_reference(inputs, options, label, run=run)


@pytest.mark.parametrize("split, halves", [(False, False), (True, True)])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("dim", [96, 128])
@pytest.mark.parametrize("layout", ["self_targets", "cross"])
def test_transposed_dq_tiles(device: str, layout: str, dim: int, activation: str, split: bool, halves: bool) -> None:
    """Over head dim 64 the dK/dV programs add dQ as transposed tiles (``K^T dS^T``, ``_add_dq_part``): the kernel
    with atomic dQ, whole and split with column halves, at head dims 128 and 96 (the upper columns of its 128-wide
    tiles masked), targets and cross segments, both activation families, against the float64 reference."""
    inputs, options, run = _launched_case(layout, 47, activation, device, one_launch=False, split=split,
                                          halves=halves, dim=dim)  # fmt: skip
    _check_against_reference(inputs, options, f"{layout}/{activation}/D={dim}/split {split}/halves {halves}", run=run)


@pytest.mark.parametrize("by_length", [False, True])
@pytest.mark.parametrize("group", [1, 2, 3, 7, 100])
def test_program_order(device: str, group: int, by_length: bool) -> None:
    """``_program_ids`` maps the launch order of a ``(A, H, Z)`` grid onto every (a, head, z) once: ``group`` pairs
    (a, head) at a time, each group z by z, the last group holding what is left; with ``BY_LENGTH`` the kernel reads
    the pairs' ``a`` from the order given (the segments longest first)."""
    from lightning_gem.ops.attention.impl.derived import segments_by_length

    num_a, heads, num_z = 5, 3, 4
    offsets = torch.tensor([0, 3, 3, 10, 11, 19])  # lengths 3, 0, 7, 1, 8: longest first 4, 2, 0, 3, 1
    order = segments_by_length(offsets)
    assert order.tolist() == ([4, 2, 0, 3, 1])
    out = torch.zeros(num_a * heads * num_z, dtype=torch.int32, device=device)
    _order_kernel[(num_a, heads, num_z)](out, order.to(device), group, by_length)
    expected = []  # launch index of each (a, head, z), pairs counted a * heads + head over a in launch order
    for first in range(0, num_a * heads, group):
        size = min(group, num_a * heads - first)
        expected += [(first + i, z) for z in range(num_z) for i in range(size)]
    want = torch.zeros(num_a * heads * num_z, dtype=torch.int32)
    for launched, (pair, z) in enumerate(expected):
        a, head = divmod(pair, heads)
        if by_length:
            a = order[a].item()
        want[(a * heads + head) * num_z + z] = launched + 1
    torch.testing.assert_close(out.cpu(), want)


def test_pair_group() -> None:
    """Pairs a group holds: as many as fill half of the L2 cache (a Hopper's 50 MiB off CUDA), at least one; a
    symbolic size (a traced call's hint) gives a symbolic count and no guard on it."""
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from lightning_gem.ops.attention.impl.triton._common import pair_group

    cpu = torch.device("cpu")
    assert pair_group(cpu, 4 << 20) == 6  # 25 MiB over 4 MiB a pair (4096 keys x 256 x 2 for K and V, bf16)
    assert pair_group(cpu, 1 << 40) == 1 and pair_group(cpu, 0) == 25 << 20
    env = ShapeEnv()
    count = pair_group(cpu, env.create_unbacked_symint() * 1024)
    assert isinstance(count, torch.SymInt) and not env.guards


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("one_launch", [False, True])
@pytest.mark.parametrize("layout", _slow_beyond(list(LAYOUTS), 2))
def test_small_pair_groups(device: str, layout: str, one_launch: bool, group: int, monkeypatch) -> None:
    """The kernels with their programs in groups of one or three (segment, head) pairs (on a GPU a group holds what
    fits in the L2 cache, on the interpreter's small shapes every pair): forward, the dK/dV kernel with atomic dQ
    (SiLU) and the one-launch kernel (softmax), every layout, under a causal window, against the float64
    reference."""
    from lightning_gem.ops.attention.impl.triton import backward, forward

    monkeypatch.setattr(forward, "pair_group", lambda device, size: group)
    monkeypatch.setattr(backward, "pair_group", lambda device, size: group)
    activation = "softmax" if one_launch else "silu"
    inputs, options, run = _launched_case(layout, 43, activation, device, one_launch=one_launch)
    _check_against_reference(inputs, options, f"{layout}/{activation}/group {group}/{one_launch}", run=run)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_split_dkdv_programs_bf16_gpu(activation: str, dim: int) -> None:
    """The split dK/dV programs in bf16 on every plan ``split_candidates`` lists, as the tuner runs them (bulk-reduced
    dQ where the plan says so and the GPU has it), targets included, within the bf16 budget of the float64
    reference."""
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    from lightning_gem.ops.attention.impl.triton._tuning import split_candidates
    from lightning_gem.ops.attention.impl.triton.backward import bulk_reduction_ok, gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    inputs = _inputs("self_targets", 17, torch.bfloat16, "cuda", q_lengths=[300, 0, 1, 64, 517, 3], max_len=520,
                     dim=dim, dim_v=dim)  # fmt: skip
    options = {**_options(activation, True, None, None), "scale": 1 / math.sqrt(dim)}
    jagged = (inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets)
    plans = split_candidates(torch.bfloat16, inputs.q.device, dim, max_len_q=520, tma=bulk_reduction_ok(inputs.q))
    assert plans
    for plan in plans:

        def run(grad_out: torch.Tensor, plan=plan) -> tuple:
            spec = Spec(*jagged, **options, max_seq_len_q=520, max_seq_len_kv=520)
            out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec)
            grads = gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, dkdv_tiles=plan.dkdv,
                                  split_dkdv=True, column_halves=plan.halves, dv_stages=plan.dv_stages,
                                  bulk_dq=plan.tma)  # fmt: skip
            return out, grads

        _check_against_reference(inputs, options, f"{activation} D={dim} split {plan}", run=run)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", ["self_targets", "shared_kv"])
def test_deterministic(device: str, layout: str, activation: str) -> None:
    """``deterministic=True`` (dQ in its own kernel) is right, and bitwise the same on a second run."""
    inputs = _inputs(layout, 21, torch.float32, device)
    options = _options(activation, True, None, None)
    _check_against_reference(inputs, options, f"{layout}/{activation}/deterministic", deterministic=True)
    grad_out = torch.randn(inputs.q.shape[0], 2, 16, device=device)
    _, first = _run_triton(inputs, grad_out, **options, deterministic=True)
    _, second = _run_triton(inputs, grad_out, **options, deterministic=True)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_deterministic_through_api(device: str) -> None:
    from lightning_gem.ops import gdpa

    inputs = _inputs("self", 22, torch.float32, device)
    q, k, v = (t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    out = gdpa(q, k, v, inputs.q_offsets, causal=True, impl="triton", deterministic=True)
    out.square().sum().backward()
    expected = gdpa(inputs.q, inputs.k, inputs.v, inputs.q_offsets, causal=True, impl="reference")
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(TypeError, match="deterministic"):
        gdpa(q, k, v, inputs.q_offsets, impl="triton", deterministic="yes")


def test_int32_offsets_and_hints(device: str) -> None:
    inputs = _inputs("shared_kv", 2, torch.float32, device, offsets_dtype=torch.int32)
    _check_against_reference(inputs, _options("softmax", True, None, None), "int32")
    exact, _ = _run_triton(inputs, **_options("silu", True, 4, None))
    hinted, _ = _run_triton(inputs, **_options("silu", True, 4, None), max_seq_len_q=64, max_seq_len_kv=64)
    torch.testing.assert_close(hinted, exact, rtol=0, atol=0)


@pytest.mark.parametrize("case", ["no_segments", "all_empty", "empty_kv"])
def test_empty(device: str, case: str) -> None:
    """No segment at all, segments without tokens, and queries over empty kv segments: zeros, zero grads."""
    if case == "no_segments":
        inputs = _inputs("self", 0, torch.float32, device, q_lengths=[])
    elif case == "all_empty":
        inputs = _inputs("self_targets", 0, torch.float32, device, q_lengths=[0, 0, 0])
    else:
        inputs = _inputs("cross", 0, torch.float32, device, q_lengths=[3, 0, 17], kv_lengths=[0, 5, 0])
    for activation in ("softmax", "silu"):
        grad_out = torch.randn(inputs.q.shape[0], 2, 16, device=device)
        out, (dq, dk, dv) = _run_triton(inputs, grad_out, **_options(activation, False, None, None))
        assert out.shape == (inputs.q.shape[0], 2, 16)
        for t in (out, dq, dk, dv):
            assert bool((t == 0).all())


def test_rejects_float64() -> None:
    _triton_device()
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    q = torch.randn(3, 1, 4, dtype=torch.float64)
    offsets = torch.tensor([0, 3])
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        gdpa_triton(q, q, q, Spec(offsets, offsets, None, None, **_options("softmax", False, None, None)))


def test_opcheck(device: str) -> None:
    _triton_device()
    importlib.import_module("lightning_gem.ops.attention.impl.triton.ops")  # registers the ops

    inputs = _inputs("self_targets", 4, torch.float32, device, q_lengths=[5, 0, 18])
    for activation in ("softmax", "silu"):
        q, k, v = (t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
        args = (q, k, v, inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets, activation, True, 6, None,
                0.25, 18, 18)  # fmt: skip
        torch.library.opcheck(torch.ops.lightning_gem.gdpa_triton.default, args)


@pytest.mark.parametrize("precision", [None, "fp8"])
def test_compile_fullgraph(device: str, precision: str | None) -> None:
    from lightning_gem.ops.attention.impl.triton import gdpa_triton

    inputs = _inputs("shared_kv", 6, torch.float32, device)
    options = {**_options("softmax", True, None, 8), "max_seq_len_q": MAX_LEN, "max_seq_len_kv": MAX_LEN,
               "precision": precision}  # fmt: skip

    def loss(q, k, v):
        out = gdpa_triton(q, k, v, Spec(inputs.q_offsets, inputs.kv_offsets, inputs.kv_index, None, **options))
        return out.square().sum()

    # The interpreter runs kernels on CPU tensors, which Inductor cannot launch: trace with AOT autograd only.
    backend = "inductor" if device == "cuda" else "aot_eager"
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    leaves = [t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    eager_leaves = [t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v)]
    value = compiled(*leaves)
    value.backward()
    expected = loss(*eager_leaves)
    expected.backward()
    torch.testing.assert_close(value, expected)
    for got, want in zip(leaves, eager_leaves, strict=True):
        torch.testing.assert_close(got.grad, want.grad)


def test_flop_counter(device: str) -> None:
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_gem.ops.attention.impl.triton import gdpa_triton
    from lightning_gem.ops.attention.ops import gdpa_flops

    inputs = _inputs("self_targets", 8, torch.float32, device)
    options = _options("silu", True, 5, None)
    mask = {name: options[name] for name in ("causal", "window", "block_size")}
    q, k, v = (t.clone().requires_grad_() for t in (inputs.q, inputs.k, inputs.v))
    jagged = (inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets)
    with FlopCounterMode(display=False) as counter:
        gdpa_triton(q, k, v, Spec(*jagged, **options)).sum().backward()
    forward = gdpa_flops(q, k, v, *jagged, **mask)
    backward = gdpa_flops(q, k, v, *jagged, **mask, backward=True)
    assert forward > 0
    assert counter.get_total_flops() == forward + backward


SHORT_MASKS = [(False, None, None), (True, None, None), (True, 5, None), (False, None, 8)]


@pytest.mark.parametrize(
    "mask", _slow_beyond(SHORT_MASKS, 2), ids=["bidirectional", "causal", "causal-window", "block"]
)
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", ["self", "cross"])
def test_short_query_backward(device: str, layout: str, activation: str, mask: tuple) -> None:
    """The short-query backward (one query tile per segment, one pass over its keys) against the float64
    reference: candidates over long histories (cross), short self-attention, empty and length-1 segments on
    either side, key tiles that no query sees (zeros), and query segments shorter than the tile."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    q_lengths = [9, 0, 1, 16, 5, 3]
    kv_lengths = [70, 33, 0, 1, 47, 3] if layout == "cross" else None
    seed = 400 + 10 * SHORT_MASKS.index(mask) + (activation == "silu") + 5 * (layout == "cross")
    inputs = _inputs(layout, seed, torch.float32, device, q_lengths=q_lengths, kv_lengths=kv_lengths)
    options = _options(activation, *mask)
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    jagged = (inputs.q_offsets, kv_offsets, None, None)
    max_kv = max(kv_lengths or q_lengths)
    spec = Spec(*jagged, **options, max_seq_len_q=16, max_seq_len_kv=max_kv)
    out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec)
    grad_out = torch.randn_like(out)
    grads = gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, short_tiles=Tiles(16, 16, 1, 1))
    again = gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, short_tiles=Tiles(16, 16, 1, 1))
    cpu64 = [t.cpu().double() for t in (inputs.q, inputs.k, inputs.v)]
    cpu_spec = Spec(*(None if t is None else t.cpu() for t in jagged), **options)
    expected = gdpa_reference_backward(grad_out.cpu().double(), *cpu64, cpu_spec)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=2e-5)
    for a, b in zip(grads, again, strict=True):
        assert torch.equal(a, b)  # no atomics: bitwise reproducible


def test_short_query_backward_refuses_what_it_cannot_serve(device: str) -> None:
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward

    inputs = _inputs("shared_kv", 1, torch.float32, device, q_lengths=[4, 2])
    options = _options("silu", False, None, None)
    args = (inputs.q, inputs.q, inputs.k, inputs.v, None, None)
    offsets = (inputs.q_offsets, inputs.kv_offsets)
    with pytest.raises(ValueError, match="short_tiles needs no kv_index"):
        spec = Spec(*offsets, inputs.kv_index, None, **options, max_seq_len_q=4, max_seq_len_kv=64)
        gdpa_backward(*args, spec, short_tiles=Tiles(16, 16, 1, 1))
    with pytest.raises(ValueError, match="block_m >= max_seq_len_q"):
        spec = Spec(*offsets, None, None, **options, max_seq_len_q=32, max_seq_len_kv=64)
        gdpa_backward(*args, spec, short_tiles=Tiles(16, 16, 1, 1))


@pytest.mark.gpu
@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_short_query_backward_bf16_gpu(activation: str) -> None:
    """Every GPU launch shape of the short-query backward, bf16, within the bf16 budget of the float64 reference."""
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    from lightning_gem.ops.attention.impl.triton._tuning import backward_candidates
    from lightning_gem.ops.attention.impl.triton.backward import gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    q_lengths, kv_lengths = [32, 0, 1, 17, 32, 5], [300, 40, 0, 1, 129, 64]
    inputs = _inputs(
        "cross", 12, torch.bfloat16, "cuda", q_lengths=q_lengths, kv_lengths=kv_lengths, dim=128, dim_v=128
    )
    options = {**_options(activation, False, None, None), "scale": 1 / math.sqrt(128)}
    jagged = (inputs.q_offsets, inputs.kv_offsets, None, None)
    plans = [p for p in backward_candidates(torch.bfloat16, torch.device("cuda"), 128, deterministic=True,
                                            max_len_q=32, short_query=True) if p.short]  # fmt: skip
    assert plans
    for plan in plans:

        def run(grad_out: torch.Tensor, plan=plan) -> tuple:
            spec = Spec(*jagged, **options, max_seq_len_q=32, max_seq_len_kv=300)
            out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec)
            grads = gdpa_backward(grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, short_tiles=plan.dkdv)
            return out, grads

        _check_against_reference(inputs, options, f"short {activation} {plan.dkdv}", run=run)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [(True, None, None), (True, 6, 8)], ids=["causal", "causal-w6-bs8"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_bulk_reduced_dq_gpu(layout: str, mask: tuple) -> None:
    """dQ added through bulk tensor reductions (sm_90+): every layout, a plain causal mask and one with every mask
    rule, bf16 at head dim 64 on two tile shapes, within the bf16 budget of the float64 reference. Segments end inside
    tiles, so the rows a tile adds past its segment's end land on the next segment's rows (zeros) and, for the last,
    past the buffer (clipped)."""
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.backward import bulk_reduction_ok, gdpa_backward
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    inputs = _inputs(
        layout, 13, torch.bfloat16, "cuda", q_lengths=[77, 0, 1, 64, 130, 3], max_len=140, dim=64, dim_v=64
    )
    if not bulk_reduction_ok(inputs.q):
        pytest.skip("bulk tensor reductions need an sm_90+ GPU")
    options = {**_options("softmax", *mask), "scale": 1 / math.sqrt(64)}
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    jagged = (inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets)
    lens = {"max_seq_len_q": max(inputs.q_lengths), "max_seq_len_kv": max(inputs.kv_lengths)}
    for tiles in (Tiles(64, 128, 8, 3), Tiles(32, 64, 4, 2)):

        def run(grad_out: torch.Tensor, tiles=tiles) -> tuple:
            spec = Spec(*jagged, **options, **lens)
            out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec)
            grads = gdpa_backward(
                grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, dkdv_tiles=tiles, bulk_dq=True
            )
            return out, grads

        _check_against_reference(inputs, options, f"{layout} bulk dQ {tiles}", run=run)


def test_bulk_reduced_dq_falls_back_when_traced(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A traced launch (here under a dispatch mode) cannot take a tensor descriptor made inside the op: the bulk plan
    then adds dQ element by element, with the same result."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_gem.ops.attention.impl.triton import backward
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    monkeypatch.setattr(backward, "bulk_reduction_ok", lambda q: True)  # as on an sm_90 GPU
    made = []
    monkeypatch.setattr(backward, "_row_tiles", lambda *args: made.append(args))
    inputs = _inputs("self_targets", 23, torch.float32, device)
    options = _options("softmax", True, None, None)
    jagged = (inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets)
    lens = {"max_seq_len_q": MAX_LEN, "max_seq_len_kv": MAX_LEN}
    spec = Spec(*jagged, **options, **lens)
    out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec)
    grad_out = torch.randn_like(out)
    tiles = Tiles(16, 16, 1, 1) if device == "cpu" else Tiles(64, 64, 4, 2)
    with FlopCounterMode(display=False):
        grads = backward.gdpa_backward(
            grad_out, inputs.q, inputs.k, inputs.v, out, lse, spec, dkdv_tiles=tiles, bulk_dq=True
        )
    assert not made, "a traced launch built a tensor descriptor"
    cpu64 = [t.cpu().double() for t in (inputs.q, inputs.k, inputs.v)]
    cpu_spec = Spec(*(None if t is None else t.cpu() for t in jagged), **options)
    expected = gdpa_reference_backward(grad_out.cpu().double(), *cpu64, cpu_spec)
    for got, want in zip(grads, expected, strict=True):
        torch.testing.assert_close(got.cpu().double(), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mask", _slow_beyond(MASKS, 3), ids=lambda m: f"causal{int(m[0])}-w{m[1]}-bs{m[2]}")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_forward_descriptor_loads(device: str, layout: str, activation: str, mask: tuple) -> None:
    """The forward reading key and value tiles through tensor descriptors: whole tiles, so an edge tile reads the
    next segment's rows (or zeros past the last), which the mask must drop. Segments end inside tiles; every layout
    and mask rule, against the float64 reference."""
    from torch.utils.flop_counter import FlopCounterMode

    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, kv_descriptors_ok

    inputs = _inputs(layout, 29, torch.float32, device, q_lengths=[45, 1, 0, 33, 20])
    if device == "cuda" and not kv_descriptors_ok(inputs.q, inputs.k, inputs.v):
        pytest.skip("descriptor loads need an sm_90+ GPU")
    assert kv_descriptors_ok(inputs.q, inputs.k, inputs.v)
    with FlopCounterMode(display=False):  # a traced launch cannot take descriptors made inside the op
        assert not kv_descriptors_ok(inputs.q, inputs.k, inputs.v)
    options = _options(activation, *mask)
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    jagged = (inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets)
    spec = Spec(*jagged, **options, max_seq_len_q=max(inputs.q_lengths), max_seq_len_kv=max(inputs.kv_lengths))
    tiles = Tiles(16, 16, 1, 1, tma=True) if device == "cpu" else Tiles(64, 64, 4, 2, tma=True)
    out, _ = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles)
    cpu64 = [t.cpu().double() for t in (inputs.q, inputs.k, inputs.v)]
    cpu_spec = Spec(*(None if t is None else t.cpu() for t in jagged), **options)
    torch.testing.assert_close(out.cpu().double(), gdpa_reference(*cpu64, cpu_spec), rtol=0, atol=1e-5)


@pytest.mark.parametrize("mask", _slow_beyond(MASKS, 3), ids=lambda m: f"causal{int(m[0])}-w{m[1]}-bs{m[2]}")
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", ["self", "cross", "shared_kv"])
def test_forward_warp_specialized(layout: str, activation: str, mask: tuple) -> None:
    """The warp-specialized forward (one loop over every key tile of a query tile, each masked; Q, K and V through
    tensor descriptors; query tiles past their segment's end run no key tile instead of returning): every layout
    without targets and every mask rule, segments ending inside tiles, against the float64 reference."""
    if _triton_device() != "cpu":
        pytest.skip(
            "the interpreter's run; compiled kernels are refused (test_warp_specialized_forward_is_refused_on_gpus)"
        )
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    # Three query tiles in the longest segment: the others' second and third run past their ends
    inputs = _inputs(layout, 31, torch.float32, "cpu", q_lengths=[145, 1, 0, 70, 20], max_len=150)
    options = _options(activation, *mask)
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    jagged = (inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets)
    spec = Spec(*jagged, **options, max_seq_len_q=max(inputs.q_lengths), max_seq_len_kv=max(inputs.kv_lengths))
    tiles = Tiles(64, 16, 4, 1, tma=True)
    out, lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles, warp_specialize=True)
    reference = gdpa_reference(inputs.q.double(), inputs.k.double(), inputs.v.double(), spec)
    torch.testing.assert_close(out.double(), reference, rtol=0, atol=1e-5)
    plain_out, plain_lse = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles)
    torch.testing.assert_close(lse, plain_lse, rtol=0, atol=1e-5)  # the log-sum-exp the backward reads


def test_warp_specialize_refuses_what_it_cannot_run() -> None:
    """``warp_specialize=True`` names what it needs: tiles of 4 warps, descriptor loads (``tma``), no targets and q's
    heads as one dense row; a call it cannot run raises before any launch."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, warp_specialize_fault

    inputs = _inputs("self_targets", 3, torch.float32, "cpu")
    jagged = (inputs.q_offsets, inputs.q_offsets, None, inputs.num_targets)
    spec = Spec(*jagged, **_options("silu", True, None, None), max_seq_len_q=MAX_LEN, max_seq_len_kv=MAX_LEN)
    q, k, v = inputs.q, inputs.k, inputs.v
    with pytest.raises(ValueError, match="`warp_specialize=True`: not with `num_targets`"):
        gdpa_forward(q, k, v, spec, tiles=Tiles(64, 16, 4, 1, tma=True), warp_specialize=True)
    assert "4 warps" in warp_specialize_fault(q, Tiles(64, 64, 8, 2), True, False, False)
    assert "64 query rows" in warp_specialize_fault(q, Tiles(32, 64, 4, 2), True, False, False)
    assert "4 warps" in warp_specialize_fault(q, None, True, False, False)  # the tuner's choice: never
    assert "tma" in warp_specialize_fault(q, Tiles(64, 64, 4, 2), False, False, False)
    assert "tma" in warp_specialize_fault(q, Tiles(64, 64, 4, 2), True, True, False)  # FP8 codes
    strided = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., : q.shape[2]]  # a split projection's view
    assert "dense" in warp_specialize_fault(strided, Tiles(64, 64, 4, 2), True, False, False)
    assert warp_specialize_fault(q, Tiles(64, 64, 4, 2), True, False, False) is None


@pytest.mark.gpu
def test_warp_specialized_forward_is_refused_on_gpus() -> None:
    """The compiled warp-specialized forward has not yet run correctly on a GPU (on an H100 its test ran past its
    time limit): on CUDA tensors ``warp_specialize=True`` raises before launching."""
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward

    inputs = _inputs("cross", 23, torch.bfloat16, "cuda", q_lengths=[300, 0, 1, 64], max_len=320, dim=64, dim_v=64)
    spec = Spec(inputs.q_offsets, inputs.kv_offsets, inputs.kv_index, None, **_options("silu", True, None, None))
    with pytest.raises(ValueError, match="interpreter only"):
        gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=Tiles(64, 64, 4, 2, tma=True), warp_specialize=True)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [64, 128, 256])
@pytest.mark.parametrize("activation", ["softmax", "silu"])
@pytest.mark.parametrize("layout", ["self_targets", "cross"])
def test_forward_descriptor_loads_bf16_gpu(layout: str, activation: str, dim: int) -> None:
    """Every forward tile candidate with key and value tiles through tensor descriptors, bf16 with the fast pointwise
    activations, within the bf16 budget of the float64 reference (the compiled kernels, where every candidate the
    tuner may time must run)."""
    if not torch.cuda.is_available() or _triton_device() != "cuda":
        pytest.skip("needs a CUDA GPU with compiled (not interpreted) Triton kernels")
    from lightning_gem.ops.attention.impl.triton._tuning import candidate_tiles
    from lightning_gem.ops.attention.impl.triton.forward import gdpa_forward, kv_descriptors_ok

    inputs = _inputs(layout, 19, torch.bfloat16, "cuda", q_lengths=[300, 0, 1, 64, 517, 3], max_len=520, dim=dim,
                     dim_v=dim)  # fmt: skip
    if not kv_descriptors_ok(inputs.q, inputs.k, inputs.v):
        pytest.skip("descriptor loads need an sm_90+ GPU")
    options = {**_options(activation, True, None, None), "scale": 1 / math.sqrt(dim)}
    kv_offsets = inputs.q_offsets if inputs.kv_offsets is None else inputs.kv_offsets
    jagged = (inputs.q_offsets, kv_offsets, inputs.kv_index, inputs.num_targets)
    lens = {"max_seq_len_q": max(inputs.q_lengths), "max_seq_len_kv": max(inputs.kv_lengths)}
    listed = candidate_tiles("fwd", torch.bfloat16, inputs.q.device, dim, max_len_q=lens["max_seq_len_q"],
                             pointwise=activation != "softmax", descriptors=True)  # fmt: skip
    for tiles in listed:

        def run(grad_out: torch.Tensor, tiles=tiles) -> tuple:
            spec = Spec(*jagged, **options, **lens)
            out, _ = gdpa_forward(inputs.q, inputs.k, inputs.v, spec, tiles=tiles._replace(tma=True))
            return out, _run_triton(inputs, grad_out, **options, **lens)[1]

        _check_against_reference(inputs, options, f"{layout} {activation} D={dim} tma {tiles}", run=run)


def test_forward_tiles_fault_rule_and_candidates() -> None:
    """The forward tiles seen to fault on sm_90 are refused, and no tuner candidate on CUDA is one of them (16-bit
    inputs, head dims up to 128, every length bucket, softmax and pointwise); BlockAttention, fp32, FP8 and head dims
    over 128 are not concerned. 128 x 32 over three stages faults with softmax only: pointwise activations list it
    first at head dims over 64 (16-bit, not FP8)."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles, candidate_tiles, forward_tiles_fault

    bf16 = torch.bfloat16
    for tiles in (Tiles(64, 32, 4, 2), Tiles(128, 32, 8, 3), Tiles(64, 16, 4, 3), Tiles(32, 16, 4, 3)):
        assert forward_tiles_fault(tiles, bf16, 128, None) and forward_tiles_fault(tiles, torch.float16, 64, None)
    for tiles in (Tiles(64, 32, 4, 2), Tiles(128, 32, 8, 2), Tiles(64, 16, 4, 3), Tiles(128, 16, 8, 3)):
        assert forward_tiles_fault(tiles, bf16, 128, None, "silu"), tiles
    assert not forward_tiles_fault(Tiles(128, 32, 8, 3), bf16, 128, None, "silu")
    assert not forward_tiles_fault(Tiles(128, 32, 8, 3), bf16, 64, None, "gelu")
    for tiles in (Tiles(64, 32, 4, 3), Tiles(128, 64, 8, 3), Tiles(64, 64, 4, 3), Tiles(32, 128, 8, 3)):
        assert not forward_tiles_fault(tiles, bf16, 128, None)
    assert not forward_tiles_fault(Tiles(128, 32, 8, 3), bf16, 256, None)  # the head-dim-256 candidate
    assert not forward_tiles_fault(Tiles(16, 16, 4, 2), bf16, 128, 16)  # a block of 16: its own tiles
    assert not forward_tiles_fault(Tiles(32, 32, 4, 2), torch.float32, 128, None)
    cuda = torch.device("cuda")
    for dim in (32, 64, 96, 128):
        for max_len_q in (8, 32, 64, 128, 1024, 1 << 30):
            for activation, descriptors in itertools.product(("softmax", "silu"), (False, True)):
                pointwise = activation != "softmax"
                listed = candidate_tiles("fwd", bf16, cuda, dim, max_len_q=max_len_q, pointwise=pointwise,
                                         descriptors=descriptors)  # fmt: skip
                for tiles in listed:
                    assert not forward_tiles_fault(tiles, bf16, dim, None, activation), (dim, max_len_q, tiles)
                first_wide = pointwise and dim > 64 and max_len_q > 64
                assert (listed[0] == Tiles(128, 32, 8, 3)) == first_wide, (dim, max_len_q, activation, listed)
    assert Tiles(128, 32, 8, 3) not in candidate_tiles("fwd", bf16, cuda, 128, pointwise=True, fp8=True)


def test_descriptor_load_candidates() -> None:
    """Where the call allows descriptor loads, the 16-bit softmax forward over query segments longer than 64 at head
    dims up to 128 lists tiles with ``tma`` after its pointer tiles (a traced call, which cannot build descriptors,
    keeps its first candidate); pointwise activations, FP8 codes, short queries, BlockAttention and head dims over
    128 list none, and neither does a call that cannot take them."""
    from lightning_gem.ops.attention.impl.triton._tuning import Tiles, candidate_tiles

    bf16, cuda = torch.bfloat16, torch.device("cuda")
    for dim in (64, 128):
        plain = candidate_tiles("fwd", bf16, cuda, dim)
        listed = candidate_tiles("fwd", bf16, cuda, dim, descriptors=True)
        assert listed[: len(plain)] == plain and not any(t.tma for t in plain)
        assert listed[len(plain) :] == [Tiles(64, 64, 4, 3, tma=True), Tiles(128, 64, 8, 3, tma=True)]
        assert Tiles(64, 64, 4, 3) != Tiles(64, 64, 4, 3, tma=True)  # both may be timed
    for options in (dict(pointwise=True), dict(fp8=True), dict(max_len_q=64), dict(block_size=64)):
        assert not any(t.tma for t in candidate_tiles("fwd", bf16, cuda, 128, descriptors=True, **options)), options
    assert not any(t.tma for t in candidate_tiles("fwd", bf16, cuda, 256, descriptors=True))
    assert not any(t.tma for t in candidate_tiles("fwd", torch.float32, cuda, 128, descriptors=True))
    assert Tiles(64, 64, 4, 3, tma=True).label == "(64, 64, 4, 3) tma" and Tiles(64, 64, 4, 3).label == "(64, 64, 4, 3)"


@pytest.mark.parametrize("flash", [False, True])
def test_a_timed_descriptor_key_leaves_its_best_pointer_tile_for_traced_calls(
    monkeypatch: pytest.MonkeyPatch, flash: bool
) -> None:
    """A forward key that allows descriptor loads (and, with ``impl="auto"``, FlashAttention-4) chooses among all its
    candidates; the key of a call of the same shape that can take neither (a traced call) gets the fastest pointer
    tile of that timing, not its first candidate. A key already chosen keeps its choice; backward keys are left
    alone."""
    from lightning_gem.ops.attention.impl.triton import _tuning
    from lightning_gem.ops.attention.impl.triton._tuning import FLASH, Tiles

    times = {Tiles(64, 32, 4, 3): 3.0, Tiles(128, 64, 8, 3): 2.0, Tiles(64, 64, 4, 3, tma=True): 1.0, FLASH: 0.5}

    def pick(registry, key, candidates, run, tensors, *, timings=None, **options):
        timings.update({c: times[c] for c in candidates})
        registry[key] = min(candidates, key=times.__getitem__)
        return registry[key]

    monkeypatch.setattr(_tuning, "pick_fastest", pick)
    _tuning.forget_choices()
    try:
        listed = [c for c in times if flash or c != FLASH]
        key = ("fwd", 128, 128, torch.bfloat16, (), None, True, 4096, 16, 30, False, flash)
        chosen = _tuning.pick_tiles(key, lambda: listed, lambda c: None, ())
        assert chosen == (FLASH if flash else Tiles(64, 64, 4, 3, tma=True))
        traced = ("fwd", 128, 128, torch.bfloat16, (), None, False, 4096, 16, 30, False, False)
        assert _tuning.chosen_tiles()[traced] == Tiles(128, 64, 8, 3)
        if flash:  # FA4's memo: the best Triton candidate, descriptors allowed
            assert _tuning.chosen_tiles()[(*key[:-1], False)] == Tiles(64, 64, 4, 3, tma=True)
        _tuning.forget_choices()
        _tuning._CHOSEN[traced] = Tiles(64, 32, 4, 3)  # tuned on its own earlier: kept
        _tuning.pick_tiles(key, lambda: listed, lambda c: None, ())
        assert _tuning.chosen_tiles()[traced] == Tiles(64, 32, 4, 3)
        backward_key = ("dkdv", *key[1:])
        _tuning.pick_tiles(backward_key, lambda: listed, lambda c: None, ())
        assert ("dkdv", *traced[1:]) not in _tuning.chosen_tiles()
    finally:
        _tuning.forget_choices()


def test_delta_launch_zeroes_the_dq_accumulator(device: str) -> None:
    """Softmax's ``delta`` launch also zeroes the atomic plans' fp32 dQ accumulator (rows past a block edge
    included), and computes the same ``delta`` with or without it."""
    from lightning_gem.ops.attention.impl.triton.backward import _delta

    generator = torch.Generator().manual_seed(5)
    out, grad_out = (torch.randn(37, 3, 24, generator=generator).to(device) for _ in range(2))
    accumulator = torch.full((37, 3, 40), float("nan"), device=device)
    delta = _delta(out, grad_out, zero=accumulator)
    expected = (out * grad_out).sum(-1).transpose(0, 1)
    torch.testing.assert_close(delta, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(accumulator, torch.zeros_like(accumulator))
    torch.testing.assert_close(_delta(out, grad_out), expected, rtol=1e-5, atol=1e-5)
