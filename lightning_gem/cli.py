"""``lightning-gem``: LightningCLI over the kit's LightningModules and DataModules.

``--ckpt_path last`` resumes the newest run: the shipped configs keep a ``last.ckpt`` (``ModelCheckpoint(save_last=
True)``) in each run's ``checkpoints/`` folder, and every run logs to a new ``version_N`` folder, so the CLI looks
for the newest ``last.ckpt`` over the runs of the logger's ``save_dir/name`` and says in one line which it takes
(or that there is none, and the run starts from the beginning).

``num_threads`` (top level of a config, or ``--num_threads``) sets torch's intra-op CPU threads before anything is
built. The CPU configs set 1: with two threads the quickstart's metrics depend on how the threads split their
reductions (its val AUC differed between a loaded and a quiet machine); with one they are the same everywhere.

A wrong value that a constructor refuses (an option outside its allowed values, a data folder without its files)
ends the command with that one message, not with the chained tracebacks of the parser's trying each type of a
``class_path`` union.

Example:
    lightning-gem --version
    lightning-gem fit --config examples/configs/quickstart.yaml
    lightning-gem fit --config examples/configs/quickstart.yaml --ckpt_path last  # after an interruption
    lightning-gem test --config examples/configs/ml100k_ctr.yaml --ckpt_path PATH/TO/CHECKPOINT.ckpt
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_gem import __version__

__all__ = ["SUMMARY", "GEMCLI", "find_last_checkpoint", "main"]


def find_last_checkpoint(trainer: Trainer) -> tuple[Path | None, Path]:
    """``(the newest last checkpoint of the trainer's runs or None, the folder searched)``.

    Searched: each ``ModelCheckpoint`` with ``save_last``: its ``dirpath`` when it has one, else the
    ``*/checkpoints`` folders of the first logger's runs (``save_dir/name/version_*``) or, without a logger,
    ``default_root_dir/checkpoints``, where Lightning puts a run's checkpoints. Newest by modification time (of
    ``meta.pt`` for a gem5d directory checkpoint, written last).
    """
    from lightning_gem.strategies.distributed_checkpoint import META_FILENAME, is_distributed_checkpoint

    callbacks = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint) and cb.save_last]
    candidates: list[Path] = []
    searched = Path(trainer.default_root_dir)
    for callback in callbacks:
        name = f"{callback.CHECKPOINT_NAME_LAST}{callback.FILE_EXTENSION}"
        if callback.dirpath is not None:
            searched = Path(callback.dirpath)
            candidates += [searched / name]
        elif trainer.loggers:
            logger = trainer.loggers[0]
            searched = Path(logger.save_dir or trainer.default_root_dir, str(logger.name or ""))
            candidates += searched.glob(f"*/checkpoints/{name}")
        else:
            searched = Path(trainer.default_root_dir, "checkpoints")
            candidates += [searched / name]
    # A directory without its meta file is a gem5d checkpoint whose save was interrupted: not a candidate.
    complete = [path for path in candidates if path.is_file() or is_distributed_checkpoint(path)]
    stamps = {path: (path / META_FILENAME if path.is_dir() else path).stat().st_mtime for path in complete}
    return (max(stamps, key=stamps.__getitem__) if stamps else None), searched


SUMMARY = (
    "lightning-gem: the command line of lightning_gem, a PyTorch Lightning plugin and component kit for training "
    "GEM-style recommendation models (jagged attention, MX/FP8 precision, the gem5d 5D-parallel strategy, "
    "rank-balanced batches)."
)
"""The first line of ``lightning-gem --help``: what the kit is."""


class _GEMArgumentParser(LightningArgumentParser):
    """A LightningArgumentParser whose help opens with ``summary`` when one is given (the main parser's)."""

    def __init__(self, *args: Any, summary: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.summary = summary

    @override
    def format_help(self) -> str:
        text = super().format_help()
        return f"{self.summary}\n\n{text}" if self.summary else text


class GEMCLI(LightningCLI):
    """LightningCLI whose model takes the DataModule's feature schema (``data.schema -> model.schema``), whose
    ``fit --ckpt_path last`` takes the newest run's ``last.ckpt`` (:func:`find_last_checkpoint`) and whose help
    opens with what the kit is."""

    def __init__(
        self, *args: Any, parser_class: type[LightningArgumentParser] = _GEMArgumentParser, **kwargs: Any
    ) -> None:
        super().__init__(*args, parser_class=parser_class, **kwargs)

    @override
    def setup_parser(
        self, add_subcommands: bool, main_kwargs: dict[str, Any], subparser_kwargs: dict[str, Any]
    ) -> None:
        if issubclass(self.parser_class, _GEMArgumentParser):
            main_kwargs = {"summary": SUMMARY, **main_kwargs}
        main_kwargs = {"description": _DESCRIPTION, **main_kwargs}
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        self.parser.add_argument(
            "--version", action="version", version=f"lightning-gem {__version__}", help="Print the kit's version."
        )

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.schema", "model.init_args.schema", apply_on="instantiate")
        parser.add_argument(
            "--num_threads",
            type=int | None,
            default=None,
            help="torch's intra-op CPU threads (torch.set_num_threads); None: torch's default (one per core)",
        )

    @override
    def before_instantiate_classes(self) -> None:
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        num_threads = config.get("num_threads")
        if num_threads is not None:
            if num_threads < 1:
                raise SystemExit(f"lightning-gem: ValueError: `num_threads` must be >= 1, got {num_threads}")
            torch.set_num_threads(num_threads)

    @override
    def instantiate_classes(self) -> None:
        """Build the model, data and trainer; a ``ValueError``, ``TypeError`` or ``OSError`` raised by one of their
        constructors exits with its own message (one line: ``lightning-gem: FileNotFoundError: ...``)."""
        try:
            super().instantiate_classes()
        except (ValueError, TypeError, OSError) as error:
            cause = error
            while cause.__cause__ is not None:  # jsonargparse re-raises a constructor's error from each union type
                cause = cause.__cause__
            message = " ".join(str(cause).split())
            raise SystemExit(f"lightning-gem: {type(cause).__name__}: {message}") from None

    def fit(self, model: LightningModule, ckpt_path: str | None = None, **kwargs: Any) -> None:
        """``trainer.fit``, with ``ckpt_path="last"`` resolved over the runs and the choice printed."""
        if ckpt_path == "last":
            found, searched = find_last_checkpoint(self.trainer)
            if self.trainer.is_global_zero:
                if found is None:
                    print(f"--ckpt_path last: no last.ckpt under {searched}; training from the start", flush=True)
                else:
                    print(f"--ckpt_path last: resuming from {found}", flush=True)
            ckpt_path = None if found is None else str(found)
        self.trainer.fit(model, ckpt_path=ckpt_path, **kwargs)


_DESCRIPTION = (
    "`lightning-gem SUBCOMMAND --help` lists a subcommand's arguments. `--config` may be given several times, "
    "later files overriding earlier ones (a base config and its overlays); the shipped configs are in "
    "examples/configs/."
)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-gem`` console script."""
    # The kit's classes register for class_path lookup, and the strategy name "gem5d" with Lightning.
    for module in ("lightning_gem.components", "lightning_gem.data", "lightning_gem.strategies"):
        importlib.import_module(module)

    GEMCLI(
        LightningModule,
        LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
