"""A callback that shows where each training step's time goes on every node and names the node that holds the job
back."""

import socket
import statistics
import sys
from collections import deque
from typing import Any

import torch
import torch.distributed as dist
from lightning.fabric.utilities.exceptions import MisconfigurationException
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.data import extract_batch_size
from torch.nn.parallel import DistributedDataParallel

from training.job.store import address_towards
from training.private_api import logging_step
from training.step_time.clocks import Clock, CpuClock, CudaClock, GradientsReady, Step
from training.step_time.figures import COMPILING, FIELDS, PARTS, Node, SlowNodeWatch, paragraph, per_node, summary


class StepTime(Callback):
    """Splits every training step of every process into waiting for data (from the end of one batch to the start
    of the next, where Lightning fetches), computing (forward, backward, optimizer) and waiting in the gradient
    allreduce (from the last gradient computed to the end of DDP's backward pass), with no synchronisation of its
    own in the step: on GPUs with CUDA events read a step or more later.

    Every ``log_every_n_steps`` the processes gather their sums (one small all_gather), and each node's mean
    milliseconds per step go to the loggers as ``timing/node<N>/{data,compute,collective,step}_ms`` with the job's
    ``timing/samples_per_s`` (at the step of the training step's own metrics, written by global rank 0). When one
    node's data or compute time stays well above the others' over ``window`` steps, every node's log gets one
    paragraph naming it, once per episode. At the end of fit every node's log gets a scaling summary: samples per
    second of the job and per process, and the shares of the step.

    Args:
        window: how many steps a node must stay slow before it is named (counted in whole log intervals).
        slower_by: how many times the other nodes' time a node's must be to count as slow.
        min_share: how much of a step a node's extra time must be to count as slow (0.2: a fifth), so that the
            noise of a busy machine names nobody.
        min_ms: how many milliseconds per step a node's extra time must be at least to count as slow: in steps of
            a few milliseconds, a busy machine's scheduler alone makes one node several times slower than another.
    """

    def __init__(self, window: int = 100, slower_by: float = 1.5, min_share: float = 0.2, min_ms: float = 10) -> None:
        fix = "set it in training.StepTime's entry of trainer.callbacks"
        if window < 1:
            raise ValueError(f"training.StepTime's window must be at least 1 step, got {window}: {fix}.")
        if slower_by < 1:
            raise ValueError(f"training.StepTime's slower_by must be at least 1, got {slower_by}: {fix}.")
        if not 0 <= min_share < 1:
            raise ValueError(f"training.StepTime's min_share must be from 0 to below 1, got {min_share}: {fix}.")
        if min_ms < 0:
            raise ValueError(f"training.StepTime's min_ms must be 0 or more, got {min_ms}: {fix}.")
        self.window = window
        self.slower_by = slower_by
        self.min_share = min_share
        self.min_ms = min_ms
        self.clock: Clock = CpuClock()
        self.collectives: GradientsReady | None = None
        self.backward_end: Any = None
        self.watch = SlowNodeWatch(window, slower_by, min_share, min_ms)
        self.where: dict[int, Node] = {}
        self.nodes: list[int] = [0]
        self.pending: list[Step] = []
        self.interval = [0.0] * len(FIELDS)
        self.total = [0.0] * len(FIELDS)
        self.started: Any = None
        self.previous_end: Any = None
        self.batches = 0
        self.recent: deque[float] = deque(maxlen=64)  # the computation of the latest steps counted, in ms

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.clock = CudaClock() if pl_module.device.type == "cuda" else CpuClock()
        self.watch = SlowNodeWatch(self.window, self.slower_by, self.min_share, self.min_ms)
        self.pending, self.previous_end, self.batches, self.backward_end = [], None, 0, None
        self.recent.clear()
        self.interval, self.total = [0.0] * len(FIELDS), [0.0] * len(FIELDS)
        if self.collectives is not None:
            self.collectives.remove()
        self.collectives = None
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            self.collectives = GradientsReady(self.clock, list(pl_module.parameters()))
        environment = getattr(trainer.strategy, "cluster_environment", None)  # None: one process, no group
        address = address_towards(environment.main_address, environment.main_port) if environment else ""
        mine = (trainer.node_rank, socket.gethostname(), address)
        everyone = [mine]
        if trainer.world_size > 1 and dist.is_initialized():
            everyone = [None] * trainer.world_size
            dist.all_gather_object(everyone, mine)
        self.nodes = [node for node, _, _ in everyone]
        self.where = {node: Node(node, host, address) for node, host, address in everyone}

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.previous_end = None  # the first batch of an epoch waits for the loader to start, not for data

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.previous_end = None  # the gap around a validation is not a wait for data

    def on_after_backward(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # DDP's backward pass returns once its allreduce is done (on a GPU: the stream waits for it).
        self.backward_end = self.clock.stamp() if self.collectives is not None else None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.started = self.clock.stamp()

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        end = self.clock.stamp()
        handed = self.collectives.take() if self.collectives else None
        done, self.backward_end = (self.backward_end if handed is not None else None), None
        if self.previous_end is not None:
            self.pending.append(Step(self.previous_end, self.started, end, handed, done, samples_in(batch)))
        self.previous_end = end
        self.settle(wait=False)
        self.batches += 1
        if trainer.log_every_n_steps > 0 and self.batches % trainer.log_every_n_steps == 0:
            self.exchange(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.settle(wait=True)
        rows = self.gather(self.total, pl_module.device)
        if trainer.local_rank == 0:
            text = summary(rows, self.nodes, self.where, self.collectives is not None)
            print(f"\n{text}", file=sys.stderr, flush=True)

    def settle(self, wait: bool) -> None:
        """Adds the steps the device has finished, in order, to the interval's and the fit's sums."""
        while self.pending and (wait or self.pending[0].ready(self.clock)):
            step = self.pending.pop(0)
            if wait:
                self.clock.settle(step.end)
                if step.done is not None:
                    self.clock.settle(step.done)
            parts = step.parts(self.clock)
            measured = (1, step.samples, *(parts[part] for part in PARTS), 0)
            counted = (0, 0, 0, 0, 0, 1) if self.compiling(parts["compute"]) else measured
            for sums in (self.interval, self.total):
                for index, value in enumerate(counted):
                    sums[index] += value

    def compiling(self, compute: float) -> bool:
        """Whether a step's computation (ms) took over COMPILING times the median of the steps before it (the least,
        of the first few): a step that compiled or warmed up, which every figure leaves out (the summary says how
        many). The first step of an epoch, where a module compiles first, is no measured step."""
        typical = statistics.median(self.recent) if len(self.recent) >= 3 else min(self.recent, default=None)
        if typical is not None and compute > COMPILING * typical:
            return True
        self.recent.append(compute)
        return False

    def exchange(self, trainer: Trainer, pl_module: LightningModule) -> None:
        rows = self.gather(self.interval, pl_module.device)
        self.interval = [0.0] * len(FIELDS)
        figures = per_node(rows, self.nodes)
        if not figures:  # an interval of first batches of an epoch: nothing measured
            return
        metrics = {f"timing/node{n}/{k}_ms": f[k] for n, f in figures.items() for k in (*PARTS, "step")}
        busy = [sum(row[FIELDS.index(part)] for part in PARTS) for row in rows]
        metrics["timing/samples_per_s"] = sum(row[1] / ms * 1e3 for row, ms in zip(rows, busy, strict=True) if ms > 0)
        # At the step Lightning writes the batch's own metrics with, to every logger, from global rank 0; not through
        # self.log, which costs a fifth of a millisecond a value.
        if trainer.is_global_zero:
            for logger in trainer.loggers:  # with the epoch, as Lightning writes every step's metrics
                logger.log_metrics({**metrics, "epoch": trainer.current_epoch}, logging_step(trainer))
        # Every process holds the same figures, so every node reaches the same verdict at the same step.
        finding = self.watch.add(trainer.log_every_n_steps, figures)
        if finding is not None and trainer.local_rank == 0:
            print(f"\n{paragraph(finding, self.where)}", file=sys.stderr, flush=True)

    def gather(self, sums: list[float], device: torch.device) -> list[list[float]]:
        """Every process's ``sums``, in global rank order: one all_gather of a few numbers."""
        mine = torch.tensor(sums, dtype=torch.float64, device=device)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return [mine.tolist()]
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        return [row.tolist() for row in everyone]


def samples_in(batch: Any) -> int:
    """The batch's size as Lightning infers it for ``self.log`` (its first tensor's length); 0 where it finds no
    tensor. A tensor or a tuple of tensors, the common batch, is read directly: Lightning's search takes half of
    what this callback costs a step."""
    first = batch[0] if isinstance(batch, list | tuple) and batch else batch
    if isinstance(first, torch.Tensor) and first.dim() > 0:
        return len(first)
    try:
        return extract_batch_size(batch)
    except MisconfigurationException:
        return 0
