"""Kernels and their references: jagged attention (GDPA). Imports torch only; Triton loads on first use."""

from lightning_gem.ops.attention import block_attention, gdpa, hstu_attention, jagged_flash_attention

__all__ = ["block_attention", "gdpa", "hstu_attention", "jagged_flash_attention"]
