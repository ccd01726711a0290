"""GDPA's host path: remembered launches (``pick_launch``: a tuned key's launch options are built once, and what a
call launches never depends on which other calls came before it) and calls that need no autograd graph.

The launch tests run no kernel (``launch`` records its arguments instead): they are about what would be launched,
so they take no interpreter time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch

from lightning_gem.ops import gdpa
from lightning_gem.ops.attention.impl.triton import _tuning, backward, forward
from lightning_gem.ops.attention.impl.triton._tuning import Tiles, forget_choices, pick_launch
from lightning_gem.ops.attention.spec import Spec

# One change from BASE each: every field that could change a launch.
BASE = dict(activation="softmax", causal=False, window=None, block_size=None, shared_kv=False, targets=False,
            head_dim=16, head_dim_v=16, dtype=torch.float32, max_q=8, deterministic=False)  # fmt: skip
CHANGES = [
    {},
    {"activation": "silu"},
    {"causal": True},
    {"window": 2},
    {"block_size": 4},
    {"block_size": 8},
    {"shared_kv": True},
    {"targets": True},
    {"head_dim": 32},
    {"head_dim_v": 32},
    {"dtype": torch.float16},
    {"max_q": 40},
    {"deterministic": True},
]


def _call(config: dict) -> None:
    """One forward and one backward of ``config`` (query segments of 3, 0 and 5 rows)."""
    q_offsets = torch.tensor([0, 3, 3, 8])
    heads, d, dv, dtype = 2, config["head_dim"], config["head_dim_v"], config["dtype"]
    kv_index = num_targets = None
    kv_offsets = q_offsets
    if config["shared_kv"]:  # query segments 0 and 2 over kv segment 0
        kv_offsets, kv_index = torch.tensor([0, 6, 10]), torch.tensor([0, 1, 0])
    if config["targets"]:
        num_targets = torch.tensor([1, 0, 2])
    num_kv = int(kv_offsets[-1])
    q, grad_out = torch.randn(8, heads, d, dtype=dtype), torch.randn(8, heads, dv, dtype=dtype)
    k, v = torch.randn(num_kv, heads, d, dtype=dtype), torch.randn(num_kv, heads, dv, dtype=dtype)
    mode = {name: config[name] for name in ("activation", "causal", "window", "block_size", "deterministic")}
    spec = Spec(q_offsets, kv_offsets, kv_index, num_targets, **mode, scale=0.25, max_seq_len_q=config["max_q"],
                max_seq_len_kv=8)  # fmt: skip
    out, lse = forward.gdpa_forward(q, k, v, spec)
    backward.gdpa_backward(grad_out, q, k, v, out, lse, spec)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> list:
    """Launches recorded as ``(kernel, grid, options)``; the tuner remembers a candidate as if it had timed them (one
    fixed by the key, so a key's choice does not depend on the order of the calls)."""
    recorded: list = []

    def record(kernel, grid, args, meta) -> None:
        recorded.append((kernel.__name__, grid, dict(meta)))

    def remember(registry, key, candidates, run, tensors, **options):
        registry[key] = candidates[zlib.crc32(repr(key).encode()) % len(candidates)]
        return registry[key]

    monkeypatch.setattr(forward, "launch", record)
    monkeypatch.setattr(backward, "launch", record)
    monkeypatch.setattr(_tuning, "pick_fastest", remember)
    forget_choices()
    yield recorded
    forget_choices()


def test_remembered_launches_are_the_ones_built_fresh(launches: list) -> None:
    configs = [{**BASE, **change} for change in CHANGES]
    fresh = []
    for config in configs:
        forget_choices()
        _call(config)
        fresh.append(launches[:])
        launches.clear()
    forget_choices()
    for _ in range(2):  # the second round takes every launch from what the first remembered
        for config, expected in zip(configs, fresh, strict=True):
            _call(config)
            assert launches == expected, config
            launches.clear()
    # A forward and a backward key each, but for `deterministic`, which changes the backward only.
    assert len(_tuning._LAUNCHES) == 2 * len(configs) - 1
    assert {kernel for kernel, _, _ in sum(fresh, [])} >= {"_gdpa_fwd_kernel", "_gdpa_bwd_kernel",
                                                          "_gdpa_bwd_dkdv_kernel"}  # fmt: skip


def test_tuned_calls_build_no_options(launches: list, monkeypatch: pytest.MonkeyPatch) -> None:
    config = {**BASE, "causal": True}
    _call(config)
    built = []
    kernel_options = forward.kernel_options

    def counted(*args):
        built.append(args)
        return kernel_options(*args)

    monkeypatch.setattr(forward, "kernel_options", counted)
    monkeypatch.setattr(backward, "kernel_options", counted)
    _call(config)
    assert built == []
    forget_choices()  # drops the remembered launches with the choices
    _call(config)
    assert len(built) >= 2


def test_pick_launch_keeps_variants_apart_and_remembers_only_settled_choices() -> None:
    forget_choices()
    tiles = [Tiles(16, 16, 1, 1), Tiles(32, 32, 4, 2)]
    built = []

    def options(variant: str):
        def build(t: Tiles) -> dict:
            built.append(variant)
            return {"BLOCK_M": t.block_m, "variant": variant}

        return build

    def noop(t: Tiles) -> None:
        return None

    key = ("fwd", "test")
    one = pick_launch(key, "cpu", lambda: tiles[:1], noop, (), options("cpu"))
    assert one == (tiles[0], {"BLOCK_M": 16, "variant": "cpu"})
    assert pick_launch(key, "cpu", lambda: tiles[:1], noop, (), options("cpu")) is one  # the only candidate: settled
    other = pick_launch(key, "cuda", lambda: tiles[:1], noop, (), options("cuda"))
    assert other[1]["variant"] == "cuda" and built == ["cpu", "cuda"]
    # Several candidates and no timing possible on CPU: the first, neither remembered nor its options.
    key = ("fwd", "untimed")
    for _ in range(2):
        assert pick_launch(key, "cpu", lambda: tiles, noop, (torch.zeros(1),), options("cpu"))[0] == tiles[0]
    assert built == ["cpu", "cuda", "cpu", "cpu"]
    forget_choices()
    assert _tuning._LAUNCHES == {}


class _DropGradient(torch.autograd.Function):
    """Passes its input on and gives it no gradient (None): the op's backward then runs with no output gradient."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return None


def _small() -> tuple[torch.Tensor, ...]:
    """Small inputs where the kernels run in this process: the CPU under the interpreter, else a CUDA GPU."""
    from triton.runtime.interpreter import InterpretedFunction

    if isinstance(forward._gdpa_fwd_kernel, InterpretedFunction):
        device = "cpu"
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip("GDPA Triton kernels need a CUDA GPU or Triton's interpreter (TRITON_INTERPRET=1)")
    offsets = torch.tensor([0, 3, 3, 5], device=device)
    return offsets, *(torch.randn(5, 2, 16, device=device, requires_grad=True) for _ in range(3))


def test_calls_without_a_graph_match_and_record_none() -> None:
    offsets, q, k, v = _small()
    with_graph = gdpa(q, k, v, offsets, causal=True, impl="triton", max_seq_len_q=3)
    with torch.no_grad():
        without = gdpa(q, k, v, offsets, causal=True, impl="triton", max_seq_len_q=3)
    detached = gdpa(q.detach(), k.detach(), v.detach(), offsets, causal=True, impl="triton", max_seq_len_q=3)
    assert with_graph.grad_fn is not None and without.grad_fn is None and detached.grad_fn is None
    torch.testing.assert_close(without, with_graph.detach(), rtol=0, atol=0)
    torch.testing.assert_close(detached, with_graph.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("activation", ["softmax", "silu"])
def test_backward_without_an_output_gradient_gives_zeros(activation: str) -> None:
    offsets, q, k, v = _small()
    out = gdpa(q, k, v, offsets, activation=activation, impl="triton", max_seq_len_q=3)
    loss = _DropGradient.apply(out).sum() + q.sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    torch.testing.assert_close(dq, torch.ones_like(q), rtol=0, atol=0)  # from q.sum() alone
    assert not dk.any() and not dv.any()


def test_host_only_profile_runs_on_cpu() -> None:
    """``attention_profile.py --host-only`` (no-op launches, in a process of its own: it patches the kernels)."""
    script = Path(__file__).resolve().parents[2] / "examples" / "benchmarks" / "attention_profile.py"
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(script), "--host-only", "--workloads", "cross", "--calls", "3"],
                          capture_output=True, text=True, timeout=300, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-4000:]
    assert "_gdpa_bwd_short_kernel" in done.stdout and "+ launch()" in done.stdout


def test_missing_length_hints_are_read_once_per_offsets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without length hints, the longest segment is read from the offsets (a device sync on a GPU) once per offsets
    tensor while it lives unchanged, not once per call: every layer of a step takes the same offsets."""
    from lightning_gem.ops.attention.impl import derived
    from lightning_gem.ops.attention.spec import with_length_hints

    reads = []
    real = derived.max_length_hint
    monkeypatch.setattr(derived, "max_length_hint", lambda *args: reads.append(args) or real(*args))
    offsets, kv_offsets = torch.tensor([0, 3, 10, 10, 12]), torch.tensor([0, 5, 6, 6, 15])
    q, k = torch.randn(12, 2, 4), torch.randn(15, 2, 4)
    spec = Spec(offsets, kv_offsets, None, None, "softmax", False, None, None, 0.5)
    for _ in range(3):
        assert with_length_hints(spec, q, k)[9:11] == (7, 9)
    assert len(reads) == 2  # the query and the kv offsets, once each
    kv_offsets[-1] = 16  # changed in place: read again
    assert with_length_hints(spec, q, k)[9:11] == (7, 10)
    assert len(reads) == 3
    assert with_length_hints(spec._replace(max_seq_len_q=8, max_seq_len_kv=9), q, k)[9:11] == (8, 9)
    assert len(reads) == 3  # hints given: nothing read
