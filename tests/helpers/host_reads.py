"""Counting, on the CPU, the host reads a GPU run would wait for: a tensor's value read into Python (``item``,
``tolist``, ``cpu``, ``numpy``, ``int``/``float``/``bool`` of it, formatting or printing it), ``torch.cuda.synchronize``
and the collectives, each with the step it happened in and the code that asked for it."""

import contextlib
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer

from tests.helpers import REPO

TENSOR_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__format__", "__repr__")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_object", "broadcast", "broadcast_object_list", "barrier")
TEMPLATE = REPO / "training"
TORCH = Path(torch.__file__).parent


@dataclass
class Read:
    what: str
    step: int
    site: str  # file:function of the innermost template frame, or "" where no template code asked for it


@dataclass
class HostReads:
    """Every host read between ``window``'s first and last batch index (the counting starts at the first batch's
    ``on_train_batch_start`` of the probe, the last callback, and ends at that of the batch after the window)."""

    window: range
    reads: list[Read] = field(default_factory=list)
    batch: int = -1
    inside: bool = False

    def record(self, what: str) -> None:
        if self.batch not in self.window:
            return
        # The code that asked: the innermost frame outside torch and this file; the template's when it is in training/.
        frames = [frame for frame in traceback.extract_stack() if not Path(frame.filename).is_relative_to(TORCH)]
        caller = Path(frames[-3].filename)
        site = f"{caller.relative_to(REPO)}:{frames[-3].name}" if caller.is_relative_to(TEMPLATE) else ""
        self.reads.append(Read(what, self.batch, site))

    def counted(self, what: str, original):
        def read(*args, **kwargs):
            if self.inside:  # one read calling another (format calls item): counted once
                return original(*args, **kwargs)
            self.inside = True
            try:
                self.record(what)
                return original(*args, **kwargs)
            finally:
                self.inside = False

        return read


COUNTERS: list[HostReads] = []  # the one ``counting`` gives, while it counts


class Probe(Callback):
    """Tells the counter which step runs: the last of the trainer's callbacks (--trainer.callbacks+=...)."""

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        COUNTERS[-1].batch = trainer.global_step


@contextlib.contextmanager
def counting(window: range) -> Iterator[HostReads]:
    """A counter of the host reads of the global steps in ``window``, while a run with ``Probe`` trains."""
    counter = HostReads(window)
    COUNTERS.append(counter)
    patched = [(torch.Tensor, name) for name in TENSOR_READS] + [(dist, name) for name in COLLECTIVES]
    patched.append((torch.cuda, "synchronize"))
    originals = [(owner, name, getattr(owner, name)) for owner, name in patched]
    try:
        for owner, name, original in originals:
            setattr(owner, name, counter.counted(name, original))
        yield counter
    finally:
        COUNTERS.remove(counter)
        for owner, name, original in originals:
            setattr(owner, name, original)
