"""Where a run keeps its checkpoints, and what a resumed run says about where it continues.

The resume itself is Lightning's: ``ckpt_path: last`` in configs/ddp.yaml loads the newest ``last*.ckpt`` of
the run's checkpoint directory, and a run without one starts from scratch.
"""

import importlib.util
import os
import re
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from training.checkpoints.contents import counters
from training.checkpoints.schedule_end import sized_schedule_note
from training.run.storage import is_remote, parent, shown

# --ckpt_path untrained: validate, test or predict with the model's untrained weights on purpose.
UNTRAINED = "untrained"


def checkpoint_dir(trainer: Trainer) -> str | None:
    """The directory ``trainer.checkpoint_callback`` writes to, resolved as ModelCheckpoint does in its setup: a local
    path or an object store URL."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint):
        return None
    if callback.dirpath:
        return str(callback.dirpath)
    if not trainer.loggers:
        return f"{str(trainer.default_root_dir).rstrip('/')}/checkpoints"
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return f"{str(logger.save_dir or trainer.default_root_dir).rstrip('/')}/{logger.name}/{version}/checkpoints"


def last_checkpoint_path(trainer: Trainer) -> str:
    """Where the run's ``last.ckpt`` is written (or was, by an earlier run with the same id)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.last_model_path:
        return str(callback.last_model_path)
    return f"{checkpoint_dir(trainer)}/{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


def last_checkpoint(trainer: Trainer) -> str | None:
    """The checkpoint ``ckpt_path: last`` loads: the newest ``last.ckpt`` (or ``last-N.ckpt``) of the run, if any."""
    directory = checkpoint_dir(trainer)
    if directory is None:
        return None
    fs = get_filesystem(directory)
    fs.invalidate_cache(directory)  # another process (an earlier attempt) wrote there
    if not fs.isdir(directory):
        return None
    found = [
        fs.unstrip_protocol(path) if is_remote(directory) else path
        for path in fs.ls(directory, detail=False)
        if re.fullmatch(r"last(-\d+)?\.ckpt", path.rstrip("/").rsplit("/", 1)[-1])
    ]
    return max(found, key=fs.modified, default=None)


def resume_path(trainer: Trainer, ckpt_path: str | None) -> str | None:
    """``ckpt_path`` as the subcommand should get it: ``last`` in an object store becomes the newest ``last.ckpt``
    there (or None), which Lightning 2.6.6 would not find (#18261: it drops the URL's protocol); ``untrained``
    becomes None; anything else as given."""
    if ckpt_path == UNTRAINED:
        return None
    if ckpt_path == "last" and is_remote(checkpoint_dir(trainer)):
        return last_checkpoint(trainer)
    return ckpt_path


def found_by_lightning(ckpt_path: str) -> bool:
    """Whether ``ckpt_path`` is a name Lightning resolves itself ("best", "hpc", a model registry), not a path."""
    return ckpt_path in ("best", "hpc") or ckpt_path.startswith("registry")


def checkpoint_problem(ckpt_path: str | None, root_dir: str | None = None, weights_only: bool = True) -> str | None:
    """What is wrong with ``--ckpt_path``, or None: a path that does not exist, a directory that is no sharded
    checkpoint (configs/fsdp.yaml writes those), a file that is no checkpoint (read as ``weights_only`` says), a name
    Lightning cannot resolve in this process. ``root_dir`` is ``trainer.default_root_dir`` (None: the working
    directory)."""
    if ckpt_path in (None, "last", UNTRAINED):
        return None
    if found_by_lightning(ckpt_path):
        return name_problem(ckpt_path, root_dir or os.getcwd())
    fs = get_filesystem(ckpt_path)
    try:
        found = fs.exists(ckpt_path)
    except Exception as error:  # an object store that cannot be reached or refuses the credentials
        return (
            f"--ckpt_path {ckpt_path} cannot be read: {type(error).__name__}: {error}. Check the store's address "
            "(AWS_ENDPOINT_URL for an S3-compatible server) and credentials (AWS_ACCESS_KEY_ID, "
            "AWS_SECRET_ACCESS_KEY or ~/.aws)."
        )
    if not found:
        return (
            f"--ckpt_path {ckpt_path}: no such checkpoint file or directory. Give the path of a .ckpt file, or of "
            "the directory of a sharded checkpoint."
        )
    if fs.isdir(ckpt_path) and not fs.isfile(f"{ckpt_path.rstrip('/')}/.metadata"):
        return (
            f"--ckpt_path {ckpt_path} is a directory, but not a sharded checkpoint (it has no .metadata file). "
            "Give the path of a .ckpt file in it, such as checkpoints/last.ckpt."
        )
    if not is_remote(ckpt_path) and Path(ckpt_path).is_file():  # a remote one is read once, by Lightning
        try:
            counters(ckpt_path, weights_only)
        except ValueError as error:
            return str(error)
    return None


def name_problem(ckpt_path: str, root_dir: str) -> str | None:
    """Why Lightning cannot resolve the name ``ckpt_path`` in a process that runs one subcommand, or None.

    Lightning finds out only once every process has started, and says so in a ValueError traceback from each (or a
    FileNotFoundError for a registry name, which it reads as a path without litmodels).
    """
    if ckpt_path == "best":
        return (
            "--ckpt_path best: Lightning resolves best to the best checkpoint of a fit that ran earlier in the same "
            "process, and cli.py runs one subcommand per process, so there is none. Give a checkpoint's path "
            "instead, such as the run's checkpoints/epochNNN-val_lossX.XXXX.ckpt (the best by the monitored "
            "metric, val/loss unless --monitor names another), or --ckpt_path last for its last.ckpt."
        )
    if ckpt_path == "hpc" and not get_filesystem(root_dir).glob(f"{root_dir.rstrip('/')}/hpc_ckpt_*.ckpt"):
        return (
            f"--ckpt_path hpc: Lightning loads the newest hpc_ckpt_N.ckpt of trainer.default_root_dir ({root_dir}), "
            "and there is none; the template saves a stopped run's checkpoint as its last.ckpt. Give a "
            "checkpoint's path, or --ckpt_path last."
        )
    if ckpt_path.startswith("registry") and importlib.util.find_spec("litmodels") is None:
        return (
            f"--ckpt_path {ckpt_path}: Lightning loads a model registry checkpoint with the litmodels package, which "
            "is not installed. Install it (pip install litmodels), or give a checkpoint's path."
        )
    return None


def start_problem(trainer: Trainer, subcommand: str, ckpt_path: str | None, weights_only: bool | None) -> str | None:
    """What keeps ``subcommand`` from starting from ``ckpt_path`` (as the config gives it) under ``trainer``, or
    None: a checkpoint that cannot be read, a fit past the end its limits set, a predict without trained weights.

    Lightning finds the first two only once every process has started, and says so in a traceback from each; this
    reads the checkpoint's two counters in the launching process instead.
    """
    if ckpt_path is not None and (ckpt_path == UNTRAINED or found_by_lightning(ckpt_path)):
        return None
    path = last_checkpoint(trainer) if ckpt_path == "last" else ckpt_path
    if path is None:
        return no_weights(trainer) if subcommand == "predict" else None
    if is_remote(path) or Path(path).is_dir():
        return None  # a checkpoint Lightning reads itself (sharded, remote)
    try:
        epochs, steps = counters(path, weights_only is not False)
    except ValueError as error:
        return str(error)
    over = []
    if subcommand == "fit" and trainer.max_epochs not in (None, -1) and epochs > trainer.max_epochs:
        over.append(f"trainer.max_epochs={trainer.max_epochs}")
    if subcommand == "fit" and trainer.max_steps != -1 and steps > trainer.max_steps:
        over.append(f"trainer.max_steps={trainer.max_steps}")
    if not over:
        return None
    run = shown(parent(checkpoint_dir(trainer) or parent(path)))
    return (
        f"the run in {run} is past the end this config sets: its checkpoint {shown(path)} was saved "
        f"at epoch {epochs - 1}, step {steps} ({epochs} epochs begun), beyond {' and '.join(over)}. To continue "
        "this run, raise that limit; to train with these settings from the start, set RUN_ID to a new run name. "
        "Nothing was started."
    )


def no_weights(trainer: Trainer) -> str:
    """The paragraph refusing a predict that has no checkpoint: its predictions would be of random weights."""
    where = shown(checkpoint_dir(trainer) or trainer.default_root_dir)
    return (
        f"nothing to predict with: {where} holds no last.ckpt and --ckpt_path names no other checkpoint, so the "
        "model's weights are untrained and its predictions random. Train the run first (cli.py fit with the same "
        "config and RUN_ID), give a checkpoint with --ckpt_path, or give --ckpt_path untrained to predict with "
        "untrained weights on purpose. Nothing was written."
    )


class ResumeReport(Callback):
    """Says where a resumed run continues (or that it trains from the first step), that there is nothing to train when
    it had already ended, and which weights validate, test and predict use: a checkpoint's, or the untrained ones when
    there is none."""

    def __init__(self) -> None:
        self.resumed_step: int | None = None
        self.loaded: str | None = None

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self.resumed_step = checkpoint["global_step"]
        self.loaded = f"{trainer.ckpt_path} (epoch {checkpoint['epoch']}, step {self.resumed_step})"
        if trainer.state.fn == "fit":
            rank_zero_info(f"Resuming from {self.loaded}.")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A run whose directory went (deleted, another disk mounted) starts from scratch as a new one does: said once.
        if trainer.ckpt_path is None:
            rank_zero_info(f"Training from the first step: no checkpoint was loaded, {self.why_none(trainer)}.")

    def why_none(self, trainer: Trainer) -> str:
        where = shown(checkpoint_dir(trainer) or trainer.default_root_dir)
        return "the config names none" if last_checkpoint(trainer) else f"{where} holds no last.ckpt"

    def report_weights(self, trainer: Trainer, doing: str) -> None:
        if trainer.state.fn == "fit":
            return
        if self.loaded:
            rank_zero_info(f"{doing} with the weights of {self.loaded}.")
        else:
            rank_zero_info(f"{doing} with untrained weights: no checkpoint was loaded, {self.why_none(trainer)}.")
        self.loaded = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report_weights(trainer, "Validating")

    def on_test_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report_weights(trainer, "Testing")

    def on_predict_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.report_weights(trainer, "Predicting")

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.resumed_step == trainer.global_step:
            # Without a ModelCheckpoint, the run is where its checkpoint came from.
            run = parent(checkpoint_dir(trainer) or trainer.ckpt_path)
            rank_zero_info(
                f"Nothing to train: the run in {run} already reached its end (epoch "
                f"{trainer.current_epoch}, step {trainer.global_step}; trainer.max_epochs={trainer.max_epochs}, "
                f"trainer.max_steps={trainer.max_steps}). Raise those to train longer, or set RUN_ID to start a new "
                f"run.{sized_schedule_note(trainer)}"
            )
        self.resumed_step = None
