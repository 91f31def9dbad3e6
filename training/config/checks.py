"""What counts as a mistake in what the user gave, and its one paragraph: every check of a subcommand's config
that runs before anything is built (so before any other process starts), and the errors of building or running
that name a setting rather than a bug."""

import inspect
from typing import Any

from lightning.pytorch import Trainer
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from training.callbacks.finite_loss import NonFiniteError
from training.checkpoints.atomic_io import CheckpointSpaceError
from training.checkpoints.resume import checkpoint_problem
from training.checkpoints.schedule_end import schedule_outrun
from training.config.gpu_support import bf16_problem, unusable_gpus_problem
from training.config.network import gloo_interface_problem, node_rank_problem
from training.config.optimizer_flags import optimizer_flags_problem
from training.config.parser import optimizer_problem
from training.config.trainer_settings import combination_problem, trainer_problem
from training.job.startup import StartupError
from training.run.csv_logger import logger_problem
from training.run.mlflow_logger import mlflow_problem
from training.run.out_of_memory import out_of_memory
from training.run.storage import storage_problem
from training.run.storage_failure import explained
from training.run.writable import unwritable_problem

FIX = "Fix the trainer settings in the config files or on the command line."
# Lightning's RuntimeError in every process whose training_step returned None, under DDP.
SKIPPED_STEP = (
    "the module's training_step returned None, to skip a batch, in a job of several processes: the others would wait "
    "for its gradients in the all-reduce, so Lightning refuses it. To skip a batch, return a loss that changes "
    "nothing instead (the loss times 0), or leave the bad samples out of the dataset; a single process "
    "(--trainer.devices=1) may return None."
)


def config_problem(settings: dict[str, Any]) -> str | None:
    """The first problem of ``settings`` (a subcommand's config, as a dict), or None."""
    root_dir = (settings.get("trainer") or {}).get("default_root_dir")
    return (
        storage_problem(settings)
        or checkpoint_problem(settings.get("ckpt_path"), root_dir, settings.get("weights_only") is not False)
        or optimizer_problem(settings)
        or optimizer_flags_problem(settings)
        or unusable_gpus_problem(settings)
        or trainer_problem(settings)
        or combination_problem(settings)
        or bf16_problem(settings)
        or mlflow_problem(settings)
        or logger_problem(settings)
        or unwritable_problem(settings)
        or node_rank_problem(settings)
        or gloo_interface_problem(settings)
    )


def instantiation_problem(error: ValueError | MisconfigurationException) -> str:
    """The paragraph for a class of the config refusing its arguments as it is built: a constructor's ValueError,
    whose message names the flag and the fix (jsonargparse wraps it in a report on each type it tried: the class,
    then None), or Lightning's Trainer refusing a setting or a combination."""
    if isinstance(error, MisconfigurationException):
        return f"{error} {FIX}"
    return str(error.__cause__ if isinstance(error.__cause__, ValueError) else error)


def refused_setting(error: BaseException) -> str | None:
    """The paragraph for ``error`` when it is a job that cannot start, a checkpoint the disk had no room for, or
    Lightning refusing a setting once the job runs; None for any other error, a bug in code, whose traceback is
    shown whole.

    Lightning refuses a setting with a MisconfigurationException, or with a ValueError where it can check the value
    only against the data (``val_check_interval`` beyond the batches of an epoch): a ValueError raised in Lightning's
    own code that names a Trainer argument is such a refusal.
    """
    if isinstance(error, StartupError | MisconfigurationException | CheckpointSpaceError | NonFiniteError):
        return str(error)
    if isinstance(error, RuntimeError) and "by returning None in distributed training" in str(error):
        return SKIPPED_STEP
    if paragraph := explained(error):  # the run's directory deleted or full, under one process
        return paragraph
    if memory := out_of_memory(error):  # one process; a job's processes say it themselves (training/strategy.py)
        return memory
    if outrun := schedule_outrun(error):
        return outrun
    if not isinstance(error, ValueError):
        return None
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    in_lightning = frame is not None and frame.tb_frame.f_globals.get("__name__", "").startswith("lightning.")
    names = inspect.signature(Trainer.__init__).parameters
    if in_lightning and any(f"`{name}`" in str(error) for name in names):
        return f"{str(error).strip()} {FIX}"
    return None
