"""GDPA: one generalized jagged attention op (softmax, pointwise, targets, windows, blocks)."""

from lightning_gem.ops.attention.api import (
    ACTIVATIONS,
    IMPLS,
    PRECISIONS,
    block_attention,
    gdpa,
    hstu_attention,
    jagged_flash_attention,
    resolve_impl,
)

__all__ = [
    "ACTIVATIONS",
    "IMPLS",
    "PRECISIONS",
    "block_attention",
    "gdpa",
    "hstu_attention",
    "jagged_flash_attention",
    "resolve_impl",
]
