"""A callback the benchmark adds to template runs: when each training step started, and the trained weights."""

import json
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer


def clock(device: torch.device) -> float:
    """``time.perf_counter()`` once ``device`` has finished the work queued on it. A GPU runs kernels after the
    Python that queued them has moved on: read without waiting, the clock would time how fast steps are queued."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class StepTimer(Callback):
    """On global rank 0, records ``clock()`` and the process's CPU time at the start of every training batch and the
    wall clock of the first one; at the end writes them to ``out`` (JSON) and the model's weights beside it (``.pt``).
    Every rank waits for its GPU at each step, as every process of benchmarks/raw_ddp.py does."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.starts: list[float] = []
        self.cpu_starts: list[float] = []
        self.first_step_wall = 0.0
        self.threads = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        now, cpu = clock(pl_module.device), time.process_time()
        if trainer.is_global_zero:
            if not self.starts:
                self.first_step_wall = time.time()
                self.threads = torch.get_num_threads()
            self.starts.append(now)
            self.cpu_starts.append(cpu)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        now, cpu = clock(pl_module.device), time.process_time()
        if trainer.is_global_zero:
            self.starts.append(now)
            self.cpu_starts.append(cpu)
            write_record(self.out, self.starts, self.first_step_wall, self.threads, pl_module, self.cpu_starts)


def write_record(
    out: Path,
    starts: list[float],
    first_step_wall: float,
    threads: int,
    model: torch.nn.Module,
    cpu_starts: list[float],
) -> None:
    """The step start times (by the clock and in CPU time) as JSON at ``out``, the model's weights beside it (``.pt``):
    what bench.py and overhead.py read."""
    record = {"starts": starts, "cpu_starts": cpu_starts, "first_step_wall": first_step_wall, "threads": threads}
    out.write_text(json.dumps(record))
    torch.save(model.state_dict(), out.with_suffix(".pt"))
