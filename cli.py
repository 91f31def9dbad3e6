"""Train, validate, test or predict any LightningModule / LightningDataModule chosen by ``class_path``.

One process (CPU, or one GPU):
    python cli.py fit -c configs/ddp.yaml --trainer.devices=1

One node, every visible GPU (or 2 CPU processes on gloo when there is no GPU):
    python cli.py fit -c configs/ddp.yaml

One node, N GPUs (here 4 of them):
    CUDA_VISIBLE_DEVICES=0,1,2,3 python cli.py fit -c configs/ddp.yaml --trainer.devices=4

N nodes (here 2, each with GPUs 0-3): set MASTER_ADDR in scripts/cluster.env and num_nodes in the
config, then run the same command on every node, only the node rank differs:
    ./scripts/run_ddp_train.sh 0,1,2,3 0  # on node 0, the master
    ./scripts/run_ddp_train.sh 0,1,2,3 1  # on node 1

Add training features, one YAML file each (mixed precision, accumulation, profiling, FSDP; see README.md):
    python cli.py fit -c configs/ddp.yaml -c configs/bf16.yaml -c configs/accumulate.yaml

Evaluate or predict from a checkpoint:
    python cli.py test -c configs/ddp.yaml --ckpt_path logs/toy/default/checkpoints/last.ckpt

Any other module plugs in without editing this file:
    python cli.py fit --model my_package.MyModel --data my_package.MyData --trainer.max_epochs=1
"""

import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import torch
import yaml
from jsonargparse import set_loader
from jsonargparse._optionals import get_omegaconf_loader
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from training import AtomicCheckpointIO, PreemptionCheckpoint, RNGStateCheckpoint, StartupError
from training.fingerprint import checkpoint_fact, code_digest, config_items
from training.resume import checkpoint_dir, checkpoint_progress, find_last_checkpoint

# Lightning's own bar redraws after every step; each redraw reads the logged values (a GPU sync) and costs about a
# millisecond, and in a node's log file every redraw is more text. A bar in the config keeps its own rate.
PROGRESS_BAR_REFRESH_STEPS = 20

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
    resumed_step: int | None = None

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Shapes and token ids come from the data, so a config never states them twice. jsonargparse skips these
        # links for a model or data module without the attributes.
        parser.link_arguments("data.num_features", "model.init_args.in_features", apply_on="instantiate")
        parser.link_arguments("data.num_targets", "model.init_args.out_features", apply_on="instantiate")
        for name in ("vocab_size", "pad_id", "bos_id", "eos_id"):
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")

    def before_instantiate_classes(self) -> None:
        if self.subcommand is None:  # main(run=False): no checkpoint to load, no config to save
            return
        config = self.config[self.subcommand]
        # Unpickling a checkpoint can run any code it carries; plain tensors and types cannot.
        if config.get("weights_only") is None:
            config["weights_only"] = True
        # validate/test/predict log into the run too; their configs must not overwrite the training one.
        name = "config.yaml" if self.subcommand == "fit" else f"{self.subcommand}-config.yaml"
        self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": name}
        # Without this, a mistyped path surfaces as a FileNotFoundError traceback from every rank.
        ckpt_path = config.get("ckpt_path")
        if ckpt_path in (None, "last", "best", "hpc") or ckpt_path.startswith("registry"):
            return
        # A sharded checkpoint (configs/fsdp.yaml) is a directory.
        if not get_filesystem(ckpt_path).exists(ckpt_path):
            self.parser.error(
                f"--ckpt_path {ckpt_path}: no such checkpoint file or directory. Give the path of a .ckpt file, "
                "or of the directory of a sharded checkpoint."
            )

    def instantiate_classes(self) -> None:
        # A constructor rejecting its arguments is a config error: report it like one, without a traceback.
        try:
            super().instantiate_classes()
        except ValueError as error:
            # jsonargparse wraps the constructor's message in a report on each type it tried (the class, then
            # None); the constructor's own message is the one that names the flag and the fix.
            self.parser.error(str(error.__cause__ if isinstance(error.__cause__, ValueError) else error))

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        configured = self._get(self.config_init, "trainer", default={}).get("callbacks") or []
        configured = list(configured) if isinstance(configured, list) else [configured]
        trainer = super().instantiate_trainer(**kwargs)
        bar = trainer.progress_bar_callback
        if type(bar) is TQDMProgressBar and all(bar is not callback for callback in configured):
            trainer.callbacks[trainer.callbacks.index(bar)] = TQDMProgressBar(refresh_rate=PROGRESS_BAR_REFRESH_STEPS)
        return trainer

    def after_instantiate_classes(self) -> None:
        strategy = self.trainer.strategy
        if type(strategy.checkpoint_io) is TorchCheckpointIO:
            strategy.checkpoint_io = AtomicCheckpointIO()

    def before_fit(self) -> None:
        """Run the same command again and it continues the run (same checkpoint directory) where it stopped."""
        config = self.config_init[self.subcommand]
        last = find_last_checkpoint(self.trainer) if config["ckpt_path"] is None else None
        if last is not None:
            config["ckpt_path"] = str(last)
            epoch, self.resumed_step = checkpoint_progress(last)
            rank_zero_info(f"Resuming from {last} (epoch {epoch}, step {self.resumed_step}).")
            # Expected when resuming into the run's own directory.
            warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")
        self.share_facts()

    def fit(self, model: Any, **kwargs: Any) -> None:
        try:
            self.trainer.fit(model, **kwargs)
        except RuntimeError as error:
            if self.resumed_step is None or "Error(s) in loading state_dict" not in str(error):
                raise
            raise StartupError(
                f"the run's checkpoint {kwargs['ckpt_path']} holds another model than the config builds now "
                f"({str(error).splitlines()[1].strip()}). To resume, restore the model settings of that run; to "
                "train the changed model, start a new run with RUN_ID=<new id>."
            ) from error

    def after_fit(self) -> None:
        if self.resumed_step is not None and self.trainer.global_step == self.resumed_step:
            rank_zero_info(
                f"Nothing to train: the run in {checkpoint_dir(self.trainer).parent} already reached its end "
                f"(epoch {self.trainer.current_epoch}, step {self.trainer.global_step}; trainer.max_epochs="
                f"{self.trainer.max_epochs}, trainer.max_steps={self.trainer.max_steps}). Raise those to train "
                "longer, or set RUN_ID to start a new run."
            )

    def share_facts(self) -> None:
        """What every node must agree on, checked by the DDP start-up handshake."""
        if hasattr(self.trainer.strategy, "startup_facts"):
            self.trainer.strategy.startup_facts.update(
                {
                    "config": config_items(self.config[self.subcommand].as_dict()),
                    "project code": code_digest(),
                    "checkpoint": checkpoint_fact(self.config_init[self.subcommand].get("ckpt_path")),
                }
            )

    before_validate = before_test = before_predict = share_facts


def main(args: list[str] | None = None, run: bool = True) -> CLI:
    """Parse ``args`` (default: the command line) and run its subcommand; with ``run=False``, only build the
    model, data module and trainer that a config without a subcommand describes."""
    OmegaConf.register_resolver("gpus_or", gpus_or, replace=True)
    set_loader("omegaconf", naming_the_file(get_omegaconf_loader("omegaconf")), (yaml.YAMLError,))
    try:
        return CLI(
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            trainer_defaults={"callbacks": [RNGStateCheckpoint(), PreemptionCheckpoint()]},
            parser_kwargs={"parser_mode": "omegaconf"},
            save_config_kwargs={"overwrite": True},
            args=args,
            run=run,
        )
    except StartupError as error:
        # Every process of the job stops with the same paragraph: one copy per node is enough.
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {error}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
