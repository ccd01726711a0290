"""``lightning-gem``: LightningCLI over the kit's LightningModules and DataModules.

Example:
    lightning-gem fit --config examples/configs/quickstart.yaml
    lightning-gem test --config examples/configs/ml100k_ctr.yaml --ckpt_path PATH/TO/CHECKPOINT.ckpt
"""

from __future__ import annotations

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from typing_extensions import override

__all__ = ["GEMCLI", "main"]


class GEMCLI(LightningCLI):
    """LightningCLI whose model takes the DataModule's feature schema (``data.schema -> model.schema``)."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.schema", "model.init_args.schema", apply_on="instantiate")


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
