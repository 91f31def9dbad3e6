"""Where a run keeps its checkpoints, and which one the same command resumes from."""

import os
from pathlib import Path

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint


def checkpoint_dir(trainer: Trainer) -> Path | None:
    """The directory ``trainer.checkpoint_callback`` writes to, resolved as ModelCheckpoint does in its setup."""
    callback = trainer.checkpoint_callback
    if not isinstance(callback, ModelCheckpoint):
        return None
    if callback.dirpath:
        return Path(callback.dirpath)
    if not trainer.loggers:
        return Path(trainer.default_root_dir) / "checkpoints"
    logger = trainer.loggers[0]
    version = logger.version if isinstance(logger.version, str) else f"version_{logger.version}"
    return Path(logger.save_dir or trainer.default_root_dir) / str(logger.name) / version / "checkpoints"


def last_checkpoint_path(trainer: Trainer) -> Path:
    """Where the run's ``last.ckpt`` is written (or was, by an earlier run with the same id)."""
    callback = trainer.checkpoint_callback
    if isinstance(callback, ModelCheckpoint) and callback.last_model_path:
        return Path(callback.last_model_path)
    return checkpoint_dir(trainer) / f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


def find_last_checkpoint(trainer: Trainer) -> Path | None:
    """The newest ``last*.ckpt`` of the run, if an earlier run with the same id left one."""
    directory = checkpoint_dir(trainer)
    if directory is None or not directory.is_dir():
        return None
    candidates = [p for p in directory.glob(f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}*{ModelCheckpoint.FILE_EXTENSION}")]
    return max(candidates, key=os.path.getmtime, default=None)


def checkpoint_progress(path: Path) -> tuple[int, int]:
    """(epoch, global step) recorded in a checkpoint file or a sharded checkpoint directory, without its tensors."""
    # A sharded (FSDP) checkpoint keeps everything but the tensors in meta.pt.
    file = path / "meta.pt" if path.is_dir() else path
    checkpoint = torch.load(file, map_location="cpu", weights_only=True, mmap=not path.is_dir())
    return checkpoint["epoch"], checkpoint["global_step"]
