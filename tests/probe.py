"""Callbacks the tests add on the command line to observe or pace a real run."""

import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer


class RankProbe(Callback):
    """Saves ``rank<N>.pt`` in ``out_dir``: world size, backend, pid, inputs seen in epoch 0, final parameters."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.inputs: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.current_epoch == 0:
            self.inputs.append(batch[0].detach().cpu().clone())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "pid": os.getpid(),
            "inputs": torch.cat(self.inputs),
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        }
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")


class SlowDown(Callback):
    """Sleeps after every training batch and writes the global step to ``progress_file``, so a test can
    interrupt a run at a known point in the middle of an epoch."""

    def __init__(self, seconds: float, progress_file: str) -> None:
        self.seconds = seconds
        self.progress_file = Path(progress_file)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        time.sleep(self.seconds)
        if trainer.global_rank == 0:
            self.progress_file.write_text(str(trainer.global_step))
