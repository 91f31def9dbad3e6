"""Train, validate, test or predict any LightningModule / LightningDataModule chosen by ``class_path``.

One process (CPU, or one GPU):
    python cli.py fit -c configs/ddp.yaml --trainer.devices=1

One node, every visible GPU (or 2 CPU processes on gloo when there is no GPU; CUDA_VISIBLE_DEVICES picks GPUs):
    python cli.py fit -c configs/ddp.yaml

N nodes (here 2, each with GPUs 0-3), from one machine over ssh: a hostfile with one host per line, the master first:
    ./scripts/launch_cluster.sh hosts 0,1,2,3
or by hand: set MASTER_ADDR in scripts/cluster.env and num_nodes in the config, then run the same command on every
node, only the node rank differs:
    ./scripts/run_ddp_train.sh 0,1,2,3 0  # on node 0, the master
    ./scripts/run_ddp_train.sh 0,1,2,3 1  # on node 1

Evaluate or predict from a checkpoint (without --ckpt_path: the run's last.ckpt):
    python cli.py test -c configs/ddp.yaml --ckpt_path logs/toy/default/checkpoints/last.ckpt

Any other module plugs in without editing this file:
    python cli.py fit --model my_package.MyModel --data my_package.MyData --trainer.max_epochs=1
"""

import os
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from training import DDPStrategy
from training.combinations import combination_problem, refused_setting, trainer_problem
from training.config_loader import use_omegaconf_loader
from training.fingerprint import config_items
from training.mlflow_logger import mlflow_problem
from training.parser import Parser, optimizer_problem
from training.resume import checkpoint_problem, past_end, resume_path
from training.run_record import RunRecord, name_the_logger
from training.storage import storage_problem

# Lightning 2.6 calls a pytree API that torch 2.13 deprecates, once per batch; nothing a user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
# Expected with `ckpt_path: last` (configs/ddp.yaml): a new run has no last.ckpt, a resumed one writes into its own.
# training.ResumeReport says which weights a run uses instead.
warnings.filterwarnings("ignore", message=r'\.\w+\(ckpt_path="last"\) is set, but there is no last checkpoint')
warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")


class CLI(LightningCLI):
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Shapes and token ids come from the data, never stated twice; skipped for modules without them.
        parser.link_arguments("data.num_features", "model.init_args.in_features", apply_on="instantiate")
        parser.link_arguments("data.num_targets", "model.init_args.out_features", apply_on="instantiate")
        for name in ("vocab_size", "pad_id", "bos_id", "eos_id"):
            parser.link_arguments(f"data.{name}", f"model.init_args.{name}", apply_on="instantiate")
        # Set before the Trainer, which reads it when it picks the GPU; torch has it per process, not per model.
        parser.add_argument(
            "--matmul_precision",
            choices=("highest", "high", "medium"),
            default="highest",
            help="torch.set_float32_matmul_precision: high and medium let float32 matrix products use TF32 or "
            "bfloat16 tensor cores (Ampere GPUs and newer), faster and less exact; highest is torch's default",
        )

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        super().parse_arguments(parser, args)
        # LightningCLI reads a --ckpt_path file's hyperparameters next: a wrong path or file would end there in a
        # traceback from every rank.
        subcommand = self.config.get("subcommand")
        if not subcommand:
            return
        config = self.config[subcommand]
        if problem := storage_problem(config.as_dict()) or checkpoint_problem(
            config.get("ckpt_path"), config.get("trainer.default_root_dir")
        ):
            parser.error(problem)

    def before_instantiate_classes(self) -> None:
        # validate/test/predict log into the run too; their configs must not overwrite the training one.
        name = "config.yaml" if self.subcommand == "fit" else f"{self.subcommand}-config.yaml"
        self.save_config_kwargs = {**self.save_config_kwargs, "config_filename": name}
        config = self.config[self.subcommand]
        settings = config.as_dict()
        problem = optimizer_problem(settings) or trainer_problem(settings) or combination_problem(settings)
        if problem := problem or mlflow_problem(settings):
            self.parser.error(problem)
        torch.set_float32_matmul_precision(config.matmul_precision)
        name_the_logger(config, self.subcommand)  # the model's name; validate/test/predict in a sub_dir of the run

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except ValueError as error:  # a constructor rejecting its arguments, a config error: no traceback
            # jsonargparse wraps the constructor's message, which names the flag and the fix, in a report on
            # each type it tried (the class, then None).
            self.parser.error(str(error.__cause__ if isinstance(error.__cause__, ValueError) else error))
        except MisconfigurationException as error:  # Lightning's Trainer rejecting a setting or a combination
            self.parser.error(f"{error} Fix the trainer settings in the config files or on the command line.")

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.strategy, DDPStrategy):  # every node must run the same config
            trainer.strategy.startup_facts["config"] = config_items(self.config[self.subcommand].as_dict())
        if self.subcommand:  # ckpt_path: last in an object store, which Lightning 2.6.6 cannot search (resume.py)
            config = self.config_init[self.subcommand]
            config.ckpt_path = resume_path(trainer, config.ckpt_path)
        return trainer

    def before_fit(self) -> None:
        # Runs in the launching process: a run past its end stops here, before any other process starts.
        problem = past_end(self.trainer, self.config_init.fit.ckpt_path, self.config.fit.weights_only)
        if problem:
            self.parser.error(problem)


def main(args: list[str] | None = None, cli: type[CLI] = CLI) -> CLI:
    """Parse ``args`` (default: the command line) and run its subcommand with ``cli``."""
    use_omegaconf_loader()
    try:
        return cli(
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=False,
            parser_class=Parser,
            parser_kwargs={"parser_mode": "omegaconf"},
            save_config_callback=RunRecord,
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except Exception as error:
        if (paragraph := refused_setting(error)) is None:  # a bug: its whole traceback
            raise
        if os.environ.get("LOCAL_RANK", "0") == "0":  # every process has the same paragraph: one per node
            print(f"\nerror: {paragraph}", file=sys.stderr)  # on a line of its own, after a progress bar
        sys.exit(1)


if __name__ == "__main__":
    main()
