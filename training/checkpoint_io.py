"""Checkpoints written to a temporary file beside their destination and renamed into place."""

import os
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO


class AtomicCheckpointIO(TorchCheckpointIO):
    """Saves local checkpoints atomically: a process killed mid-save leaves the previous checkpoint intact.

    The checkpoint is streamed to ``.<name>.partial`` in the destination directory, synced to disk, then
    renamed over the destination. Lightning's own save goes through a temporary file in the system temp
    directory, which becomes a non-atomic copy when that is another filesystem (a mounted volume, say).
    A ``.partial`` file left by a kill is overwritten by the next save of the same checkpoint.
    """

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: str | os.PathLike, storage_options: Any | None = None
    ) -> None:
        if not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)  # object stores upload atomically
            return
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options, got {storage_options!r}")
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.partial")
        with open(partial, "wb") as file:
            torch.save(checkpoint, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)
        directory = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(directory)  # make the rename itself survive a crash
        finally:
            os.close(directory)
