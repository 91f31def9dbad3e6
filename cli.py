"""Train, validate, test or predict any LightningModule / LightningDataModule chosen by ``class_path``.

One process (CPU, or one GPU):
    python cli.py fit -c configs/ddp.yaml --trainer.devices=1

One node, every visible GPU (or 2 CPU processes on gloo when there is no GPU):
    python cli.py fit -c configs/ddp.yaml

One node, N GPUs (here 4 of them):
    CUDA_VISIBLE_DEVICES=0,1,2,3 python cli.py fit -c configs/ddp.yaml --trainer.devices=4

N nodes (here 2, each with 4 GPUs): the same command on every node, only NODE_RANK differs:
    export MASTER_ADDR=10.0.0.1 MASTER_PORT=29500 NUM_NODES=2  # on every node; MASTER_ADDR is node 0
    NODE_RANK=0 python cli.py fit -c configs/ddp.yaml --trainer.devices=4  # on node 0
    NODE_RANK=1 python cli.py fit -c configs/ddp.yaml --trainer.devices=4  # on node 1

Evaluate or predict from a checkpoint:
    python cli.py test -c configs/ddp.yaml --ckpt_path logs/toy/version_0/checkpoints/last.ckpt

Any other module plugs in without editing this file:
    python cli.py fit --model my_package.MyModel --data my_package.MyData --trainer.max_epochs=1
"""

import warnings
from collections.abc import Callable
from typing import Any

import torch
import yaml
from jsonargparse import set_loader
from jsonargparse._optionals import get_omegaconf_loader
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

# Lightning 2.6 calls a pytree API that torch 2.13 deprecates, once per batch; nothing a user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)


def gpus_or(cpu_processes: int) -> int | str:
    """Value for ``trainer.devices``: every visible GPU, or ``cpu_processes`` processes without one."""
    return "auto" if torch.cuda.is_available() else int(cpu_processes)


def naming_the_file(load: Callable[[str], Any]) -> Callable[..., Any]:
    """Wrap a config loader so YAML and interpolation errors say which file they come from."""

    def load_config(value: str, path: str = "") -> Any:
        source = f"config file {path}" if path else "a command-line value"
        try:
            return load(value)
        except yaml.YAMLError as error:
            raise yaml.YAMLError(f"{source} is not valid YAML: {error}") from error
        except OmegaConfBaseException as error:
            raise yaml.YAMLError(
                f"{source}: {error}\nEach config file is resolved on its own, so ${{...}} can only refer to keys of "
                "the same file, and ${oc.env:VAR} needs VAR set or a default, as in ${oc.env:VAR,default}."
            ) from error

    return load_config


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Shapes and token ids come from the data, so a config never states them twice. jsonargparse skips these
        # links for a model or data module without the attributes.
        parser.link_arguments("data.num_features", "model.init_args.in_features", apply_on="instantiate")
        parser.link_arguments("data.num_targets", "model.init_args.out_features", apply_on="instantiate")
        for name in ("vocab_size", "pad_id", "bos_id", "eos_id"):
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        # Without this, a mistyped path surfaces as a FileNotFoundError traceback from every rank.
        ckpt_path = self.config[self.subcommand].get("ckpt_path") if self.subcommand else None
        if ckpt_path in (None, "last", "best", "hpc") or ckpt_path.startswith("registry"):
            return
        if not get_filesystem(ckpt_path).isfile(ckpt_path):
            self.parser.error(f"--ckpt_path {ckpt_path}: no such checkpoint file. Give the path of a .ckpt file.")

    def instantiate_classes(self) -> None:
        # A constructor rejecting its arguments is a config error: report it like one, without a traceback.
        try:
            super().instantiate_classes()
        except ValueError as error:
            # jsonargparse wraps the constructor's message in a report on each type it tried (the class, then
            # None); the constructor's own message is the one that names the flag and the fix.
            self.parser.error(str(error.__cause__ if isinstance(error.__cause__, ValueError) else error))


def main(args: list[str] | None = None) -> CLI:
    OmegaConf.register_resolver("gpus_or", gpus_or, replace=True)
    set_loader("omegaconf", naming_the_file(get_omegaconf_loader("omegaconf")), (yaml.YAMLError,))
    return CLI(
        subclass_mode_model=True,
        subclass_mode_data=True,
        auto_configure_optimizers=False,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
    )


if __name__ == "__main__":
    main()
