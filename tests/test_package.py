"""Packaging: the import is light, components/ and strategies/ ship inside the package, the CLI exists,
the "gem5d" strategy name resolves."""

from __future__ import annotations

import ast
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> str:
    # From an empty folder: the clone's parent may hold a folder named lightning_gem (the clone itself), which
    # Python would import from the working directory as a namespace package instead of the installed one.
    with tempfile.TemporaryDirectory() as cwd:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=cwd)
    return out.stdout.strip()


def _import_seconds(code: str) -> tuple[float, str]:
    start = time.perf_counter()
    out = _run(code)
    return time.perf_counter() - start, out


@pytest.mark.slow  # six fresh interpreters
def test_import_is_light() -> None:
    # Against importing torch alone, in alternating rounds (the fastest of each), so a slow or busy machine moves
    # both: the kit's own import (its modules and custom op registrations) adds under a second, and loads none of
    # the heavy packages.
    kit = "import sys, lightning_gem, lightning_gem.ops, lightning_gem.jagged; print(sorted({m.split('.')[0] for m in "
    kit += "sys.modules} & {'triton', 'torchrec', 'lightning', 'fbgemm_gpu'}))"
    torch_alone, elapsed = [], []
    for _ in range(3):
        torch_alone.append(_import_seconds("import torch")[0])
        seconds, loaded = _import_seconds(kit)
        elapsed.append(seconds)
        assert loaded == "[]", f"importing lightning_gem pulled {loaded}"
    assert min(elapsed) - min(torch_alone) < 1.0, (
        f"import took {min(elapsed):.2f} s, torch alone {min(torch_alone):.2f} s"
    )


@pytest.mark.parametrize(
    "imports",
    [
        "import lightning as L, lightning_gem",  # Lightning loaded first: the package root registers
        pytest.param(  # the kit first: its modules register
            "import lightning_gem.components; import lightning as L", marks=pytest.mark.slow
        ),
    ],
)
def test_gem5d_strategy_name_resolves(imports: str) -> None:
    name = _run(
        f"{imports}; print(type(L.Trainer(strategy='gem5d', accelerator='cpu', devices=1, logger=False).strategy)"
        ".__name__)"
    ).splitlines()[-1]
    assert name == "GEM5DStrategy"


def test_subpackages_resolve_from_the_installed_package() -> None:
    paths = _run(
        "import lightning_gem.components as c, lightning_gem.strategies as s; print(c.__file__); print(s.__file__)"
    ).splitlines()
    assert Path(paths[0]).parent.name == "components"
    assert Path(paths[1]).parent.name == "strategies"


def test_strategies_import_no_component() -> None:
    """Dependencies point one way: the components import the strategies (to register "gem5d"), never back."""
    for path in sorted((ROOT / "strategies").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            assert not any(name.startswith("lightning_gem.components") for name in names), (path.name, node.lineno)


@pytest.mark.slow
def test_wheel_ships_components_and_strategies(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = tmp_path.glob("lightning_gem-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for expected in (
        "lightning_gem/__init__.py",
        "lightning_gem/components/__init__.py",
        "lightning_gem/strategies/__init__.py",
        "lightning_gem/strategies/activation_checkpointing/planner.py",
        "lightning_gem/ops/attention/impl/reference.py",
        "lightning_gem/ops/pointwise/impl/triton/kernels.py",
        "lightning_gem/data/datamodule.py",
    ):
        assert expected in names, f"{expected} missing from {wheel.name}"
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "lightning-gem = lightning_gem.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_every_package_directory_is_listed_in_pyproject() -> None:
    """pyproject.toml lists the packages explicitly: a new subpackage left out would be missing from a wheel."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    roots = {"lightning_gem": ROOT / "lightning_gem", "lightning_gem.components": ROOT / "components"}
    roots["lightning_gem.strategies"] = ROOT / "strategies"
    on_disk = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            parts = init.parent.relative_to(root).parts
            if not any(p.startswith(".") or p == "__pycache__" for p in parts):
                on_disk.add(".".join((name, *parts)))
    assert on_disk <= listed, sorted(on_disk - listed)
