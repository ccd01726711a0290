"""GDPA in Triton: forward and backward kernels over jagged tensors, registered as torch custom ops.

Importing this package imports Triton; :mod:`lightning_gem.ops.attention.api` imports it only when
``impl="triton"`` is chosen. On CPU the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``
set before this package is imported); bfloat16 is wrong in that interpreter, so it is tested on GPUs.
"""

from lightning_gem.ops.attention.impl.triton.ops import SUPPORTED_DTYPES, gdpa_triton

__all__ = ["SUPPORTED_DTYPES", "gdpa_triton"]
