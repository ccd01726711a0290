"""Numerical budgets for tests: judge a low-precision result by what the same precision can achieve.

A hand-tuned ``atol`` hides regressions on one input and fails on the next. Instead, a result in a
low-precision dtype is compared with a float64 oracle, and its error must stay within a small multiple
of the error that a straightforward computation in that same dtype makes on the same inputs.

Example:
    >>> import torch
    >>> from lightning_gem.testing.numerics import assert_within_budget
    >>> exact = torch.linspace(-1, 1, 7, dtype=torch.float64)
    >>> naive = (exact.half() * 3).double() / 3  # a same-precision computation
    >>> assert_within_budget(exact.half(), exact, naive, name="x")
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["assert_within_budget", "max_abs_error"]


def max_abs_error(actual: Tensor, expected: Tensor) -> float:
    """``max |actual - expected|`` in float64 (0 for empty tensors)."""
    if actual.numel() == 0:
        return 0.0
    return float((actual.detach().to(torch.float64) - expected.detach().to(torch.float64)).abs().max())


def assert_within_budget(
    actual: Tensor, oracle: Tensor, same_precision: Tensor, *, name: str, slack: float = 2.0, ulps: float = 4.0
) -> None:
    """Assert ``max|actual - oracle| <= slack * max|same_precision - oracle| + ulps * eps * max|oracle|``.

    Args:
        actual: the result under test, in its (low-precision) dtype.
        oracle: the float64 ground truth on the same (already rounded) inputs.
        same_precision: the same quantity computed naively in ``actual``'s dtype: its error is the budget.
        name: what is compared, for the failure message.
        slack: how many budgets the result may use.
        ulps: a floor, in units of ``actual``'s dtype at the output's scale (``eps * max|oracle|``).

    The floor is there because one same-precision run can be lucky: rounding the exact answer alone
    costs half an ulp, and two sound computations that sum in different orders (bucketed vs padded,
    explicit backward vs autograd, another BLAS or thread count) each land a few ulps off. Seen: a float32
    ``dq`` 1.9 ulps off where the same-precision run was 0.4 ulps off. A real precision bug (an operand
    rounded to a narrower dtype) is orders of magnitude above a few ulps of the dtype under test.
    """
    assert actual.shape == oracle.shape == same_precision.shape, (name, actual.shape, oracle.shape)
    if actual.numel() == 0:
        return
    assert bool(torch.isfinite(actual).all()), f"{name}: non-finite values"
    error = max_abs_error(actual, oracle)
    budget = max_abs_error(same_precision, oracle)
    ulp = torch.finfo(actual.dtype).eps * float(oracle.detach().abs().max())
    allowed = slack * budget + ulps * ulp
    assert error <= allowed, (
        f"{name}: max abs error {error:.3g} vs the float64 oracle exceeds {allowed:.3g} "
        f"({slack} x the {actual.dtype} same-precision error {budget:.3g} + {ulps} ulps of {ulp:.3g})"
    )
