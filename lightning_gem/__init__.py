"""lightning_gem: GEM-style training efficiency for PyTorch Lightning recommendation models.

Importing the package is cheap: it imports torch only. Submodules that pull Lightning, torchrec or
Triton (``lightning_gem.components``, ``lightning_gem.data``, ``lightning_gem.strategies``) load when
first used.

The ``"gem5d"`` strategy name: importing ``lightning_gem`` registers it in Lightning's strategy registry
when Lightning is already imported (``import lightning`` first, as Lightning scripts do); importing
``lightning_gem.strategies``, ``lightning_gem.components`` or ``lightning_gem.cli`` (the ``lightning-gem``
command) registers it in any order. The package root does not import Lightning itself, which would
make every ``lightning_gem.ops`` user pay for it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

__version__ = "0.1.0"

_SUBMODULES = {
    "callbacks",
    "cli",
    "components",
    "data",
    "jagged",
    "metrics",
    "ops",
    "precision",
    "strategies",
    "testing",
}


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(_SUBMODULES))


if "lightning.pytorch" in sys.modules:
    importlib.import_module(f"{__name__}.strategies")  # registers "gem5d" (see the module docstring)
