"""The template's LightningCLI: what it checks before a run starts, and how it reports a mistake in what it was
given (one paragraph, no traceback). cli.py runs it."""

import atexit
import contextlib
import functools
import os
import sys
import warnings
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from training.checkpoints.agreement import given_settings_problem
from training.checkpoints.resume import resume_path, start_problem
from training.config.checks import config_problem, instantiation_problem, refused_setting
from training.config.kept_lists import lists_problem, turn_off
from training.config.links import given_model, link_data_to_model, print_config_with_links, record_links
from training.config.loader import use_omegaconf_loader
from training.config.parser import Parser
from training.config.trainer_settings import cores_warning
from training.job import early
from training.job.fingerprint import config_items
from training.job.forked import end_forked_with_this_process
from training.job.node_processes import end_after_error, let_later_end, speaks_for_node
from training.job.stop_signal import REQUESTS
from training.job.vector_math import settle_vector_math
from training.private_api import LIGHTNING_2_5, ckpt_path_read_as_lightning_2_6, subcommand_parser
from training.run.record import RunRecord, name_the_logger
from training.strategy import DDPStrategy

# Lightning 2.6 calls a pytree API that torch 2.13 deprecates, once per batch; nothing a user can act on.
warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
# Expected with `ckpt_path: last`: a new run has no last.ckpt, a resumed one writes into its own (ResumeReport says).
warnings.filterwarnings("ignore", message=r'\.\w+\(ckpt_path="last"\) is set, but there is no last checkpoint')
warnings.filterwarnings("ignore", message="Checkpoint directory .* exists and is not empty")


def without_config(subcommand: str) -> str:
    return (
        "note: no config file (-c) given: Lightning's own defaults apply, not this template's setup (configs/ddp.yaml):"
        " no run id and no resume, none of its checkpoint rules, checks or DDP settings, and logs in "
        f"lightning_logs/version_N. For the template's setup: python cli.py {subcommand} -c configs/ddp.yaml "
        "--model ... --data ..."
    )


@ckpt_path_read_as_lightning_2_6
class CLI(LightningCLI):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        given = sys.argv[1:] if kwargs.get("args") is None else kwargs["args"]
        self.command_line = given if isinstance(given, list) else None  # None: a config given as a dict or Namespace
        super().__init__(*args, **kwargs)

    def subcommands(self) -> dict[str, set[str]]:
        # Only the subcommand that comes first on the command line gets a parser: each of Lightning's four costs about
        # 0.03 s of CPU in every process that starts, a third of the parse. Without one (cli.py --help), all four.
        every = LightningCLI.subcommands()
        first = self.command_line[0] if self.command_line else None
        return {first: every[first]} if first in every else every

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        # Shapes and token ids come from the data, never stated twice; skipped for modules without them.
        link_data_to_model(parser)
        # Set before the Trainer, which reads it when it picks the GPU; torch has it per process, not per model.
        tip = "torch.set_float32_matmul_precision: high and medium use tensor cores (Ampere GPUs on), less exact"
        parser.add_argument("--matmul_precision", choices=("highest", "high", "medium"), default="highest", help=tip)
        # One metric for the best checkpoint and early stopping: the config files name it ${monitor}.
        parser.add_argument("--monitor", default="val/loss", help="the metric the best checkpoint is chosen by")
        parser.add_argument("--monitor_mode", choices=("min", "max"), default="min", help="best: its min or max")
        tip = "callbacks and plugins of trainer.callbacks and trainer.plugins this run leaves out, by class name"
        parser.add_argument("--turn_off", type=list[str], default=[], help=tip)
        if LIGHTNING_2_5:  # Lightning 2.6's option, which its Trainer.fit, validate, test and predict take
            tip = "load checkpoints as torch.load(weights_only=True) does: tensors and plain types only"
            parser.add_argument("--weights_only", type=bool | None, default=None, help=tip)

    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        if self.command_line is not None:
            print_config_with_links(parser, functools.partial(subcommand_parser, self), self.command_line)
        super().parse_arguments(parser, args)
        # Before LightningCLI reads a --ckpt_path file's hyperparameters: a wrong path would end there in a traceback.
        subcommand = self.config.get("subcommand")
        if subcommand and (problem := config_problem(self.config[subcommand].as_dict())):
            parser.error(problem)
        # A later list of callbacks or plugins that replaces the template's (kept_lists.py).
        if subcommand and (
            problem := lists_problem(
                self.command_line, self.config[subcommand].trainer, self.config[subcommand].turn_off
            )
        ):
            parser.error(problem)
        # Said once per node, by the process that starts the others: the run goes on.
        if subcommand and (warning := cores_warning(self.config[subcommand].as_dict())) and speaks_for_node():
            print(f"warning: {warning}", file=sys.stderr)
        # What was given for the model, apart from the defaults: a parse of its own, made only where a check needs it.
        self.given_model = functools.cache(lambda: given_model(parser, args, subcommand) if subcommand else {})
        # LightningCLI builds the model a --ckpt_path file's hyperparameters describe, whatever was given instead.
        if subcommand and (problem := given_settings_problem(self.config[subcommand].ckpt_path, self.given_model)):
            parser.error(problem)

    def before_instantiate_classes(self) -> None:
        if not self.config[self.subcommand].get("config") and speaks_for_node():
            print(without_config(self.subcommand), file=sys.stderr)
        torch.set_float32_matmul_precision(self.config[self.subcommand].matmul_precision)
        turn_off(self.config[self.subcommand].trainer, self.config[self.subcommand].turn_off)
        name_the_logger(self.config[self.subcommand], self.subcommand)  # validate/test/predict: in a sub_dir of the run

    def instantiate_classes(self) -> None:
        try:
            super().instantiate_classes()
        except (ValueError, MisconfigurationException) as error:  # a config error: no traceback
            self.parser.error(instantiation_problem(error))
        if problem := record_links(self.config[self.subcommand], self.datamodule, self.given_model):
            self.parser.error(problem)

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        if isinstance(trainer.strategy, DDPStrategy):  # every node must run the same config
            trainer.strategy.startup_facts["config"] = config_items(self.config[self.subcommand].as_dict())
        if self.subcommand:  # ckpt_path: last in an object store, which Lightning 2.6.6 cannot search (resume.py)
            config = self.config_init[self.subcommand]
            config.ckpt_path = resume_path(trainer, config.ckpt_path)
        return trainer

    def check_start(self) -> None:
        # Runs in the launching process: an unreadable checkpoint, a run past its end or a predict without trained
        # weights stops here, before any other process starts.
        config = self.config[self.subcommand]
        if LIGHTNING_2_5 and config.get("weights_only") is not None:  # 2.5 loads every checkpoint as a full pickle
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = str(int(config.weights_only))  # torch's own switch
        if problem := start_problem(self.trainer, self.subcommand, config.ckpt_path, config.get("weights_only")):
            self.parser.error(problem)
        # A data module may say what it cannot feed this many processes (data.Seq2SeqDataModule does).
        check = getattr(self.datamodule, "processes_problem", None) if self.subcommand in ("fit", "validate") else None
        if check is not None and (problem := check(self.trainer.world_size)):
            self.parser.error(problem)
        # From here the job's stop requests (SIGTERM, Ctrl-C, SIGHUP) go to training/job/stop_signal.py, and nothing
        # this process forks (DataLoader workers) outlives it.
        if early.taken():
            REQUESTS.start(self.trainer)
            end_forked_with_this_process()

    before_fit = before_validate = before_test = before_predict = check_start


def main(args: list[str] | None = None, cli: type[CLI] = CLI) -> CLI:
    """Parse ``args`` (default: the command line) and run its subcommand with ``cli``."""
    settle_vector_math()  # before training's ops run on several threads, and DataLoader workers fork
    use_omegaconf_loader()
    try:
        return cli(
            subclass_mode_model=True,
            subclass_mode_data=True,
            auto_configure_optimizers=True,  # --optimizer, --lr_scheduler (training/config/optimizer_flags.py)
            parser_class=Parser,
            parser_kwargs={"parser_mode": "omegaconf+"},
            save_config_callback=RunRecord,
            save_config_kwargs={"overwrite": True},
            args=args,
        )
    except BrokenPipeError:
        stop(CLOSED_OUTPUT, closed=True)
    except Exception as error:
        if (paragraph := refused_setting(error)) is None:  # a bug: its whole traceback, then how the job ended
            atexit.register(end_after_error, getattr(error, "job_stopped", None))
            raise
        stop(paragraph)


# `python cli.py fit ... | head`: the run stops as a program writing into a closed pipe does, without a traceback.
CLOSED_OUTPUT = (
    "the output of cli.py was closed by whoever read it (a pipe into head, say), so the run stopped. The same "
    "command resumes from the run's last checkpoint; to read part of the output while training goes on, send it to a "
    "file (python cli.py fit ... > train.log 2>&1) and read that."
)


def stop(paragraph: str, closed: bool = False) -> None:
    """End the process with ``paragraph``, said once per node; with ``closed``, its output has no reader any more."""
    if speaks_for_node():  # every process has the same paragraph: one per node
        with contextlib.suppress(OSError):  # on a closed output, stderr may be closed too
            print(f"\nerror: {paragraph}", file=sys.stderr, flush=True)  # on a line of its own, after a progress bar
    if closed:  # what is still buffered, flushed as the interpreter exits, goes nowhere instead of failing again
        for fd in (1, 2):
            os.dup2(os.open(os.devnull, os.O_WRONLY), fd)
    let_later_end()  # the node's others meet it too, and stay silent while this process lives
    sys.exit(1)
