"""Checkpoint saves the processes of a job agree on: a save that fails stops every process at once, each saying
why, and a save counts as complete once the processes pass the next barrier."""

import os
import socket
from typing import Any

from training.checkpoints.atomic_io import CheckpointSpaceError
from training.heartbeat.liveness import Liveness


class SaveAgreement:
    """What DDPStrategy (training/strategy.py) adds to Lightning's saves; it sets ``liveness`` and ``saved``."""

    liveness: Liveness | None
    saved: dict[str, Any] | None  # a checkpoint this process saw saved, complete at the next barrier

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        # Every process comes here; global rank 0 writes. A full disk stops them all at once, each saying why,
        # instead of rank 0 alone, with the others left to find a collective broken.
        failure, host = None, socket.gethostname()
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        except CheckpointSpaceError as error:
            failure = str(error)
        if self.world_size > 1:
            failure, host = self.broadcast((failure, host))
        if failure is not None:
            told = f"this node stopped with global rank 0, on node 0 ({host}), where {failure}"
            raise CheckpointSpaceError(failure if self.is_global_zero else told)
        path = str(filepath) if "://" in str(filepath) else os.path.abspath(filepath)
        self.saved = {"path": path, "epoch": checkpoint.get("epoch"), "step": checkpoint.get("global_step")}

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        super().barrier(*args, **kwargs)
        # Global rank 0 saves before it reaches any barrier: once this one passed, the save is done, or, written in
        # the background (training.AtomicCheckpointIO), queued: rank 0, which writes it, counts it once on disk.
        if self.saved is not None and self.liveness is not None:
            saved, liveness = self.saved, self.liveness
            when_written = getattr(self.checkpoint_io, "when_written", None) if self.is_global_zero else None
            (when_written or (lambda callback: callback()))(lambda: liveness.checkpoint_saved(**saved))
        self.saved = None
