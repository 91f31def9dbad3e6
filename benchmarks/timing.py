"""How every side of the benchmark times its steps (StepMarks), and the callback that does it for the template's and
Lightning's runs: when each training step started, and the trained weights."""

import json
import time
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer

from training.step_time.clocks import CpuClock, CudaClock

# What the table says about the clock, so that a reader knows what a GPU step time includes and what it waited for.
CLOCKS = {
    "cpu": "step clock: time.perf_counter() at the start of each step",
    "gpu": (
        "step clock: a CUDA event recorded at the start of each step, read once after the last step (no wait for "
        "the GPU within the steps)"
    ),
}


class StepMarks:
    """A mark at the start of each step on ``device``, read as seconds once the last step is marked.

    On a GPU a mark is a CUDA event recorded on the current stream (training.step_time's CudaClock, as StepTime
    uses): recording it waits for nothing, and it completes when the GPU reaches it, so two marks are one step apart
    on the GPU's timeline however far the CPU has queued ahead, and as far apart as the CPU's steps when the GPU
    waits for the CPU. ``seconds`` waits for the last event only, after the last step: the one wait the clock adds
    to a run. Waiting for the GPU at every step instead would time the step without its overlap of CPU and GPU
    work, and add a wait that training does not have. On the CPU a mark is ``time.perf_counter()``."""

    def __init__(self, device: torch.device) -> None:
        self.clock = CudaClock() if device.type == "cuda" else CpuClock()
        self.stamps: list = []

    def mark(self) -> None:
        self.stamps.append(self.clock.stamp())

    def __len__(self) -> int:
        return len(self.stamps)

    def seconds(self) -> list[float]:
        """Each mark's seconds after the first."""
        if not self.stamps:
            return []
        self.clock.settle(self.stamps[-1])  # events of one stream complete in order: every earlier one is done
        return [self.clock.ms(self.stamps[0], stamp) / 1e3 for stamp in self.stamps]


class StepTimer(Callback):
    """Marks the start of every training batch, and the end of training, with StepMarks on every rank alike, and the
    process's CPU time at each; global rank 0 writes the marks to ``out`` (JSON) with the wall clock of its first
    step, and the model's weights beside it (``.pt``), as every process of benchmarks/raw_ddp.py marks its steps and
    its rank 0 writes them."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.marks: StepMarks | None = None
        self.cpu_starts: list[float] = []
        self.first_step_wall = 0.0
        self.threads = 0

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if self.marks is None:
            self.marks = StepMarks(pl_module.device)
            self.first_step_wall = time.time()
            self.threads = torch.get_num_threads()
        self.marks.mark()
        self.cpu_starts.append(time.process_time())

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.marks is None:  # no step: a record of the end alone
            self.marks = StepMarks(pl_module.device)
        self.marks.mark()
        self.cpu_starts.append(time.process_time())
        if trainer.is_global_zero:
            seconds = self.marks.seconds()
            write_record(self.out, seconds, self.first_step_wall, self.threads, pl_module, self.cpu_starts)


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
