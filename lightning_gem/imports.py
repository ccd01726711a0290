"""Availability of the kit's optional dependencies, in one place.

Each flag is a ``lightning_utilities`` ``RequirementCache``: truthy when the pinned distribution is installed
and its module imports (checked on first use, then cached), and its ``str`` says what is missing and how to
install it. Code that needs an optional package checks the flag at call time and imports inside the function.
"""

from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

__all__ = ["FA4_AVAILABLE", "FA4_INSTALL"]

# FlashAttention-4 (CuTe DSL): GDPA's ``impl="flash"`` backend and a candidate of ``impl="auto"``. The kit calls
# its varlen forward and backward functions directly, so the version is pinned to the one it is tested with.
FA4_AVAILABLE = RequirementCache("flash-attn-4==4.0.0b36", "flash_attn.cute.interface")
FA4_INSTALL = "pip install 'lightning-gem[fa4]'"
