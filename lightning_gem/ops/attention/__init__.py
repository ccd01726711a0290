"""GDPA: one generalized jagged attention op (softmax, pointwise, targets, windows, blocks)."""

from lightning_gem.ops.attention.api import (
    IMPLS,
    block_attention,
    gdpa,
    hstu_attention,
    jagged_flash_attention,
    resolve_impl,
)

__all__ = ["IMPLS", "block_attention", "gdpa", "hstu_attention", "jagged_flash_attention", "resolve_impl"]
