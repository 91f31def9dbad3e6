"""Random number generator states of every rank, saved in each checkpoint and restored on resume."""

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn


def collect_rng_states() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's generators, in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), position, has_gauss, cached_gauss],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def restore_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    kind, keys, position, has_gauss, cached_gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gauss))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


class RNGStateCheckpoint(Callback):
    """Puts each rank's generator states in the checkpoint, and gives each rank its own back on resume.

    Lightning restores model, optimizer, schedulers and loop counters but not these, so without them a
    resumed run draws other dropout masks (and, in one process, another shuffle) than an uninterrupted one.
    """

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = collect_rng_states()
        if dist.is_available() and dist.is_initialized() and trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("rng_states")
        if saved is None:
            return
        if len(saved) != trainer.world_size:
            rank_zero_warn(
                f"The checkpoint holds random states for {len(saved)} processes but this run has "
                f"{trainer.world_size}: they are not restored, so the resumed run will not repeat the interrupted "
                "one bit for bit."
            )
            return
        restore_rng_states(saved[trainer.global_rank])
