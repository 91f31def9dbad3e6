"""A callback the DDP tests add on the command line to record what each rank did."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer


class RankProbe(Callback):
    """Saves ``rank<N>.pt`` in ``out_dir``: world size, backend, pid, inputs seen in epoch 0, final parameters
    and the DataModule's state.

    Args:
        out_dir: where to write.
        input_key: which part of a batch to record as its inputs: a position in a tuple batch or a key of a dict batch.
    """

    def __init__(self, out_dir: str, input_key: int | str = 0) -> None:
        self.out_dir = Path(out_dir)
        self.input_key = input_key
        self.inputs: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.current_epoch == 0:
            self.inputs.append(batch[self.input_key].detach().cpu().clone())

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
            "datamodule_state": trainer.datamodule.state_dict() if trainer.datamodule else {},
        }
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")
