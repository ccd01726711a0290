"""gem5d with real processes on CPU/gloo: the GEM example trains at 2 and 4 ranks in every layout that fits,
with the losses and weights of a single process on the same global batch.

Each test spawns one group of processes (``gloo_runner.run_ranks``) that trains several layouts in turn.
The comparisons use SGD for the dense layers (see ``gem_workloads.make_model``) and, where a table has
replicas, for the embeddings: replicas are averaged after each step, which equals one update on the
whole batch for SGD only (with Adam it is torchrec's 2D approximation).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest
from gem_workloads import fit_gem
from gloo_runner import run_ranks

STEPS = 5
GLOBAL_BATCH = 8
LOSS_RTOL = 1e-5
WEIGHT_ATOL = 2e-6


def _train_layouts(
    rank: int, world_size: int, layouts: list[dict[str, Any]], bad_layouts: tuple[dict[str, Any], ...] = ()
) -> tuple[list[dict[str, Any]], list[str]]:
    """Train each layout in turn in this group of processes (rank 0 returns the losses and full weights),
    then try each bad layout and return the error each raised."""
    results = []
    for kwargs in layouts:
        out = fit_gem(world_size, kwargs, steps=STEPS, global_batch=GLOBAL_BATCH)
        results.append(out if rank == 0 else {})
    errors = []
    for kwargs in bad_layouts:
        try:
            fit_gem(world_size, kwargs, steps=1, global_batch=GLOBAL_BATCH)
        except ValueError as err:
            errors.append(str(err))
        else:
            errors.append("no error")
    return results, errors


@functools.cache
def _single_process(embedding_optimizer: str) -> dict[str, Any]:
    return run_ranks(_train_layouts, 1, [{"embedding_optimizer": embedding_optimizer}])[0][0][0]


def _check_matches(result: dict[str, Any], reference: dict[str, Any], layout: dict[str, Any]) -> None:
    assert len(result["losses"]) == STEPS, layout
    np.testing.assert_allclose(result["losses"], reference["losses"], rtol=LOSS_RTOL, err_msg=str(layout))
    assert result["weights"].keys() == reference["weights"].keys()
    for name, value in result["weights"].items():
        np.testing.assert_allclose(value, reference["weights"][name], atol=WEIGHT_ATOL, err_msg=f"{name} {layout}")
    # the run trained: the loss moved
    assert result["losses"][-1] < result["losses"][0] - 0.05, layout


def _layouts(world_size: int) -> list[dict[str, Any]]:
    """Every sparse group size x (dense replicate, dense shard) of ``world_size`` ranks (tensor parallel 1)."""
    sizes = [d for d in range(1, world_size + 1) if world_size % d == 0]
    return [
        {
            "sparse_group_size": group,
            "dense_replicate_size": replicate,
            # one group: no replicas, so an adaptive optimizer's update is exact too
            "embedding_optimizer": "rowwise_adagrad" if group == world_size else "sgd",
        }
        for group in sizes
        for replicate in sizes
    ]


BAD_LAYOUTS = (
    ({"sparse_group_size": 3}, "`sparse_group_size` (3) must be <= the world size (2)"),
    ({"dense_replicate_size": 2, "dense_shard_size": 2}, "= 4 must equal the world size (2)"),
    ({"table_constraints": {"no_such_table": {"sharding_types": ["row_wise"]}}}, "tables ['no_such_table']"),
)


@pytest.mark.parametrize("world_size", [2, 4])
def test_every_layout_trains_like_one_process(world_size: int) -> None:
    layouts = _layouts(world_size)
    # the bad configurations ride along in the 2-rank processes (a spawn costs more than a fit)
    bad = BAD_LAYOUTS if world_size == 2 else ()
    results, errors = run_ranks(_train_layouts, world_size, layouts, tuple(kwargs for kwargs, _ in bad))[0]
    for layout, result in zip(layouts, results, strict=True):
        _check_matches(result, _single_process(layout["embedding_optimizer"]), layout)
    for (kwargs, message), error in zip(bad, errors, strict=True):
        assert message in error, (kwargs, error)
