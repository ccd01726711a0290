"""Implementations of :mod:`lightning_gem.ops.pointwise`: the PyTorch reference and the Triton kernels."""
