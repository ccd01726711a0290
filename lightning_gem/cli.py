"""``lightning-gem``: LightningCLI over the kit's LightningModules and DataModules.

Example:
    lightning-gem --version
    lightning-gem fit --config examples/configs/quickstart.yaml
    lightning-gem test --config examples/configs/ml100k_ctr.yaml --ckpt_path PATH/TO/CHECKPOINT.ckpt
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

from lightning_gem import __version__

__all__ = ["SUMMARY", "GEMCLI", "main"]

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
    """LightningCLI whose model takes the DataModule's feature schema (``data.schema -> model.schema``) and whose
    help opens with what the kit is."""

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


_DESCRIPTION = (
    "`lightning-gem SUBCOMMAND --help` lists a subcommand's arguments. `--config` may be given several times, "
    "later files overriding earlier ones (a base config and its overlays); the shipped configs are in "
    "examples/configs/."
)


def main(args: list[str] | None = None) -> None:
    """Entry point of the ``lightning-gem`` console script."""
    import lightning_gem.components  # noqa: F401  (registers the kit's classes for class_path lookup)
    import lightning_gem.data  # noqa: F401
    import lightning_gem.strategies  # noqa: F401  (registers `strategy: gem5d`)

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
