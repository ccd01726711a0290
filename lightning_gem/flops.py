"""Analytic and measured FLOPs of training steps on jagged batches, and peak throughput of accelerators.

The efficiency equation of the kit is ``E2E MFU = local MFU x scaling ratio`` (``DESIGN.md``); this
module supplies the numerator of local MFU (model FLOPs) and its denominator (the device's peak).

- :func:`linear_flops`: ``2 * T * in * out`` forward; the backward (grad input + grad weight) is twice that.
- :func:`gdpa_flops`: FLOPs of one GDPA call over its allowed (query, key) pairs (re-exported from
  :mod:`lightning_gem.ops.attention.ops`, where the same formula is registered with the FLOP counter).
- :class:`MatmulFlopCounter`: counts the FLOPs of the ops run under it by torch's FLOP formulas, running every
  op exactly as called (``FlopCounterMode`` runs some ops through their decompositions, which round differently).
- :func:`model_flops`: a model's FLOPs on a real batch, measured by :class:`MatmulFlopCounter`.
- :func:`attention_cost_coefficients`: ``(a, b)`` of ``cost(len) = a * len + b * len**2`` for a stack
  of HSTU layers, for :class:`lightning_gem.data.balancing.AttentionCostModel`.
- :func:`peak_tflops`: dense bf16 peak TFLOP/s of a device by name.

Only matmul work is counted (``mm``, ``addmm``, ``bmm``, SDPA, the GDPA ops): elementwise ops, norms,
softmax and embedding lookups count zero FLOPs, as in the usual MFU accounting.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch._ops import HigherOrderOperator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# Imported eagerly: the GDPA ops register their FLOP formulas on import, and a MatmulFlopCounter copies the
# formula registry when it is created, so an op first imported inside a counted region is not counted.
from lightning_gem.ops.attention.ops import gdpa_flops

__all__ = [
    "PEAK_BF16_TFLOPS",
    "MatmulFlopCounter",
    "attention_cost_coefficients",
    "gdpa_flops",
    "linear_flops",
    "model_flops",
    "peak_tflops",
]

#: Dense (no sparsity) bf16 tensor-core peak TFLOP/s, matched in order by a substring of the device name.
PEAK_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("B200", 2250.0),
    ("H200", 989.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # SXM
    ("A100", 312.0),
)


def linear_flops(num_tokens: int, in_features: int, out_features: int, backward: bool = False) -> int:
    """FLOPs of an ``nn.Linear(in_features, out_features)`` on ``num_tokens`` rows (the bias is not counted).

    Forward: ``2 * T * in * out``. Backward: ``4 * T * in * out`` (grad input and grad weight); when the
    input needs no gradient the backward is only the grad weight, i.e. ``linear_flops(..., backward=False)``.

    Example:
        >>> linear_flops(10, 4, 8), linear_flops(10, 4, 8, backward=True)
        (640, 1280)
    """
    for name, value in (("num_tokens", num_tokens), ("in_features", in_features), ("out_features", out_features)):
        if value < 0:
            raise ValueError(f"`{name}` must be >= 0, got {value}")
    forward = 2 * num_tokens * in_features * out_features
    return 2 * forward if backward else forward


class MatmulFlopCounter(TorchDispatchMode):
    """Counts the FLOPs of the ops run under it, by the formulas of ``torch.utils.flop_counter``.

    Unlike ``FlopCounterMode``, which runs an op without a formula through its decomposition when it has one
    (``silu_backward`` as ``sigmoid`` and products: other rounding, so a counted training step computes other
    gradients than an uncounted one), every op runs exactly as called: counting changes no value, no random
    number and no autograd graph. The FLOPs are the same: ops with formulas (the matmuls, SDPA, the GDPA ops)
    are never decomposed by either. Only totals are kept (no per-module table).

    Code compiled with ``torch.compile`` runs eagerly under the counter (the ``"force_eager"`` stance): Dynamo
    cannot compile a frame under a dispatch mode, and a frame it skipped for one is never compiled afterwards,
    so without the stance one counted step would leave a compiled model eager for the rest of the run.

    Example:
        >>> with MatmulFlopCounter() as counter:
        ...     _ = nn.Linear(4, 8)(torch.randn(10, 4))
        >>> counter.flops  # 2 * 10 * 4 * 8
        640
    """

    # Higher-order ops reach the mode too: the Triton kernel wrappers of ops launched under it (their op, which has
    # the formula, is counted where it is called) and control flow; they run as called, uncounted.
    supports_higher_order_operators = True

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0
        self._stance: Any = None

    def __enter__(self) -> MatmulFlopCounter:
        self._stance = torch.compiler.set_stance("force_eager")
        self._stance.__enter__()
        try:
            return super().__enter__()
        except BaseException:
            self._stance.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            stance, self._stance = self._stance, None
            stance.__exit__(None, None, None)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if isinstance(func, HigherOrderOperator):
            return out
        # Read at each call: a formula registered after the counter was made (an op module imported on first use,
        # inside the counted region) counts too.
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += int(formula(*args, **kwargs, out_val=out))
        return out


def model_flops(
    model: nn.Module,
    batch: Any,
    *,
    backward: bool = True,
    loss_fn: Callable[[Any], Tensor] | None = None,
) -> int:
    """FLOPs of ``model(batch)`` (plus its backward) measured by :class:`MatmulFlopCounter` on the real batch.

    Jagged shapes and masks are honoured: GDPA counts only the allowed (query, key) pairs of this batch.
    The backward is ``torch.autograd.grad`` of ``loss_fn(output)`` (default: the sum of the output, which
    adds no matmul) with respect to the trainable parameters, so no ``.grad`` is touched. It runs the model
    once more: use it to size a model, and :class:`lightning_gem.callbacks.MFUMonitor` inside training.

    Args:
        model: any module; ``model(batch)`` must return a tensor (or what ``loss_fn`` takes).
        batch: the batch, on the model's device.
        backward: add the backward FLOPs (training FLOPs); False: forward only.
        loss_fn: output -> scalar loss; default ``output.sum()``.

    Example:
        >>> model_flops(nn.Linear(4, 8), torch.randn(10, 4))  # forward 640 + grad weight 640
        1280
    """
    params = [p for p in model.parameters() if p.requires_grad]
    with MatmulFlopCounter() as counter:
        with torch.enable_grad() if backward else torch.no_grad():
            output = model(batch)
            if backward and params:
                loss = loss_fn(output) if loss_fn is not None else output.sum()
                torch.autograd.grad(loss, params, allow_unused=True)
    return counter.flops


def attention_cost_coefficients(
    model_dim: int,
    num_layers: int,
    *,
    num_heads: int = 1,
    attention_dim: int | None = None,
    linear_dim: int | None = None,
    causal: bool = True,
    backward: bool = True,
) -> tuple[float, float]:
    """``(a, b)`` with ``a * len + b * len**2`` = FLOPs of a stack of HSTU layers on one sequence.

    Per token and layer: ``uvqk`` (``dim -> H (2 Dv + 2 Dqk)``) and ``output`` (``H Dv -> dim``) by
    :func:`linear_flops`; per allowed pair: :func:`gdpa_flops`'s ``2 H (Dqk + Dv)`` forward and
    ``2 H (3 Dqk + 2 Dv)`` backward. A causal sequence of ``len`` tokens has ``len (len + 1) / 2``
    pairs, a full one ``len**2``. Norms and activations are not counted (as everywhere in this module).
    Pass the result to ``AttentionCostModel(a=a, b=b)``.

    Args:
        model_dim: layer width ``dim``.
        num_layers: HSTU layers.
        num_heads: heads ``H`` (matters only with explicit head dims).
        attention_dim, linear_dim: per-head ``Dqk`` / ``Dv``; default ``model_dim // num_heads``.
        causal: causal attention (the HSTU default).
        backward: training FLOPs (forward + backward); False: forward only.

    Example:
        >>> attention_cost_coefficients(16, 1, backward=False)  # 10 d^2 + 2 d per token, 2 d per token^2
        (2592.0, 32.0)
    """
    if model_dim < 1 or num_layers < 0 or num_heads < 1:
        raise ValueError(
            f"need model_dim >= 1, num_layers >= 0, num_heads >= 1; got {model_dim}, {num_layers}, {num_heads}"
        )
    dqk = attention_dim if attention_dim is not None else model_dim // num_heads
    dv = linear_dim if linear_dim is not None else model_dim // num_heads
    if dqk < 1 or dv < 1:
        raise ValueError(f"head dims must be >= 1, got attention_dim={dqk}, linear_dim={dv}")
    per_token = linear_flops(1, model_dim, num_heads * (2 * dv + 2 * dqk)) + linear_flops(1, num_heads * dv, model_dim)
    per_pair = 2 * num_heads * (dqk + dv)
    if backward:
        per_token *= 3
        per_pair += 2 * num_heads * (3 * dqk + 2 * dv)
    a, b = float(per_token), float(per_pair)
    if causal:  # len (len + 1) / 2 pairs
        a, b = a + b / 2, b / 2
    return a * num_layers, b * num_layers


def peak_tflops(device: torch.device | str | None = None, table: Mapping[str, float] | None = None) -> float | None:
    """Dense bf16 peak TFLOP/s of a CUDA device, by a substring of its name; None if unknown or not CUDA.

    Args:
        device: a CUDA device (default: the current one); a ``str`` not naming a device is taken as a
            device name (``"NVIDIA H100 80GB HBM3"``).
        table: name substring -> TFLOP/s, searched before :data:`PEAK_BF16_TFLOPS` (overrides).

    Example:
        >>> peak_tflops("NVIDIA H200"), peak_tflops("cpu")
        (989.0, None)
    """
    name = _device_name(device)
    if name is None:
        return None
    entries = [*(table or {}).items(), *PEAK_BF16_TFLOPS]
    for key, value in entries:
        if key.lower() in name.lower():
            return float(value)
    return None


def _device_name(device: torch.device | str | None) -> str | None:
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return device  # a device name, not a device
    if device is None:
        if not torch.cuda.is_available():
            return None
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(device)
