"""Callbacks the tests add on the command line to record what each rank did."""

import os
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer


class RankProbe(Callback):
    """Saves ``rank<N>.pt`` in ``out_dir``: world size, backend, pid, inputs seen in epoch 0, final parameters,
    the precision setting and the dtypes the model's layers (leaf modules with weights) computed in training."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.inputs: list[torch.Tensor] = []
        self.layer_dtypes: set[str] = set()

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for module in pl_module.modules():
            if not list(module.children()) and list(module.parameters(recurse=False)):
                module.register_forward_hook(self.record_dtype)

    def record_dtype(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module.training:
            self.layer_dtypes.add(str(output.dtype))

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
            "precision": trainer.precision,
            "layer_dtypes": sorted(self.layer_dtypes),
            "inputs": torch.cat(self.inputs),
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
        }
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")
