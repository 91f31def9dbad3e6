"""Random number generator states of every rank, saved in each checkpoint and restored on resume."""

import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

NOT_REPEATED = "so the resumed run will not repeat the interrupted one bit for bit."


def collect_rng_states(device: torch.device) -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's generators and of ``device``'s own CUDA generator (None off
    CUDA), in types ``torch.load(weights_only=True)`` accepts."""
    kind, keys, position, has_gauss, cached_gauss = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), position, has_gauss, cached_gauss],
        "torch": torch.get_rng_state(),
        # Only this rank's device: the other visible GPUs are other ranks' (or nobody's), and a resume may see fewer.
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def saved_cuda_state(states: dict[str, Any], device: torch.device) -> torch.Tensor | None:
    """The CUDA state saved for the rank now on ``device``, None if there is none."""
    cuda = states["cuda"]
    if isinstance(cuda, list):
        # Checkpoints written before states were kept per rank: every GPU the rank saw, by device index. Off
        # CUDA, any entry is the sign that the rank had a GPU.
        index = device.index if device.type == "cuda" else 0
        return cuda[index] if index < len(cuda) else None
    return cuda


def restore_rng_states(states: dict[str, Any], device: torch.device) -> None:
    """Put ``states`` back in this process's generators; the CUDA state, where one was saved, on ``device``."""
    random.setstate(states["python"])
    kind, keys, position, has_gauss, cached_gauss = states["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gauss))
    torch.set_rng_state(states["torch"])
    cuda = saved_cuda_state(states, device)
    if cuda is not None and device.type == "cuda":
        torch.cuda.set_rng_state(cuda, device)


class RNGStateCheckpoint(Callback):
    """Puts each rank's generator states in the checkpoint, and gives each rank its own back on resume.

    Lightning restores model, optimizer, schedulers and loop counters but not these, so without them a
    resumed run draws other dropout masks (and, in one process, another shuffle) than an uninterrupted one.
    A rank's CUDA state is that of its own device, so it follows the rank to whichever GPU the resume gives it.
    """

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        states = collect_rng_states(trainer.strategy.root_device)
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
                f"{trainer.world_size}: they are not restored, {NOT_REPEATED}"
            )
            return
        states, device = saved[trainer.global_rank], trainer.strategy.root_device
        restore_rng_states(states, device)
        cuda = saved_cuda_state(states, device)
        if (cuda is None) == (device.type == "cuda"):  # saved on a GPU and resumed on CPU, or the reverse
            rank_zero_warn(
                f"The checkpoint holds {'no' if cuda is None else 'a'} CUDA random state for rank "
                f"{trainer.global_rank} but this run puts that rank on {device}: its CUDA random state is not "
                f"restored, {NOT_REPEATED}"
            )
