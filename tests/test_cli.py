"""The ``lightning-gem`` command: its version and what its help says first."""

from __future__ import annotations

import pytest

import lightning_gem
from lightning_gem.cli import SUMMARY, main


def test_version_prints_the_kits_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"lightning-gem {lightning_gem.__version__}"


def test_help_says_what_the_kit_is_in_its_first_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == SUMMARY
    assert "PyTorch Lightning" in lines[0] and "recommendation" in lines[0]
    assert any(line.startswith("usage: ") for line in lines[1:])  # argparse's help follows it
    assert any("--version" in line for line in lines)


def test_subcommand_help_opens_with_its_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["fit", "--help"])
    assert capsys.readouterr().out.startswith("usage: ")
