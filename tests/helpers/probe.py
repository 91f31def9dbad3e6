"""Callbacks the tests add on the command line to observe or pace a real run."""

import json
import os
import signal
import threading
import time
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from torch.optim import Optimizer

from training import DDPStrategy
from training.checkpoints.atomic_io import AtomicCheckpointIO


class RankProbe(Callback):
    """Saves ``rank<N>.pt`` in ``out_dir``: world size, backend, pid, threads, usable cores, inputs seen in epoch 0,
    final parameters, the DataModule's state, the precision setting, the device, the dtypes the model's layers (leaf
    modules with weights) computed in training and the gradient scaler's state when training started (None without
    one). The inputs are one tensor of all rows seen where every batch has rows of one shape, else a list of the
    rows (as each batch padded them): seq2seq batches are padded to their longest sequence.

    Args:
        out_dir: where to write.
        input_key: which part of a batch to record as its inputs: a position in a tuple batch or a key of a dict
            batch; by default its first (a tuple's first tensor, a dict batch's first entry).
    """

    def __init__(self, out_dir: str, input_key: int | str | None = None) -> None:
        self.out_dir = Path(out_dir)
        self.input_key = input_key
        self.inputs: list[torch.Tensor] = []
        self.layer_dtypes: set[str] = set()
        self.scaler_at_start: dict | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self.scaler_at_start = scaler.state_dict() if scaler is not None else None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for module in pl_module.modules():
            if not list(module.children()) and list(module.parameters(recurse=False)):
                module.register_forward_hook(self.record_dtype)

    def record_dtype(self, module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if module.training:
            self.layer_dtypes.add(str(output.dtype))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.current_epoch == 0:
            key = self.input_key
            if key is None:
                key = next(iter(batch)) if isinstance(batch, dict) else 0
            self.inputs.append(batch[key].detach().cpu().clone())

    def recorded_inputs(self) -> torch.Tensor | list[torch.Tensor]:
        if len({batch.shape[1:] for batch in self.inputs}) > 1:
            return [row for batch in self.inputs for row in batch]
        return torch.cat(self.inputs) if self.inputs else torch.empty(0)  # a run resumed after epoch 0: none

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "global_rank": trainer.global_rank,
            "local_rank": trainer.local_rank,
            "node_rank": trainer.node_rank,
            "world_size": trainer.world_size,
            "backend": dist.get_backend() if dist.is_initialized() else None,
            "pid": os.getpid(),
            "threads": torch.get_num_threads(),
            "cores": sorted(os.sched_getaffinity(0)),
            "precision": trainer.precision,
            "device": str(pl_module.device),
            "scaler_at_start": self.scaler_at_start,
            "layer_dtypes": sorted(self.layer_dtypes),
            "inputs": self.recorded_inputs(),
            "params": {k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()},
            "datamodule_state": trainer.datamodule.state_dict() if trainer.datamodule else {},
        }
        torch.save(record, self.out_dir / f"rank{trainer.global_rank}.pt")


class BatchLog(Callback):
    """Saves ``batches<N>.pt`` in ``out_dir`` from every rank N at the end of training: the world size and, for
    every training batch, the global step it trained at, its epoch and the batch's ``key`` entry as a list."""

    def __init__(self, out_dir: str, key: str = "index") -> None:
        self.out_dir = Path(out_dir)
        self.key = key
        self.batches: list[tuple[int, int, list]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.batches.append((trainer.global_step, trainer.current_epoch, batch[self.key].tolist()))

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        record = {"world_size": trainer.world_size, "batches": self.batches}
        torch.save(record, self.out_dir / f"batches{trainer.global_rank}.pt")


class SampleLog(Callback):
    """Appends a line to ``<out_dir>/<pid>.jsonl`` for every training batch, as it starts, so a process killed
    later leaves its record: its attempt (global rank 0's clock when training started, the same on every rank),
    world size, global rank, global step, epoch and the batch's ``key`` entry."""

    def __init__(self, out_dir: str, key: str = "index") -> None:
        self.out_dir = Path(out_dir)
        self.key = key
        self.attempt = 0.0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        started = [time.time()]
        if dist.is_initialized():
            dist.broadcast_object_list(started, src=0)
        self.attempt = started[0]
        self.out_dir.mkdir(parents=True, exist_ok=True)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        record = {
            "attempt": self.attempt,
            "world_size": trainer.world_size,
            "rank": trainer.global_rank,
            "step": trainer.global_step,
            "epoch": trainer.current_epoch,
            "ids": batch[self.key].tolist(),
        }
        with open(self.out_dir / f"{os.getpid()}.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")


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


class HoldAtStep(Callback):
    """Holds every rank after training step ``step``, so a test can signal or kill a run at a step it knows,
    however fast the machine trains.

    Each rank writes ``<hold_file>.rank<N>`` when it holds, then waits until ``hold_file`` is gone or the
    process receives a stop signal (SIGTERM, SIGUSR1, SIGINT or SIGHUP), which it passes on to the handler the run
    had and records as ``<hold_file>.signalled.rank<N>``. With ``world_size``, only a job of that many processes
    holds; with ``release_on_signal=False``, a signal does not end the hold.
    """

    def __init__(
        self, step: int, hold_file: str, world_size: int | None = None, release_on_signal: bool = True
    ) -> None:
        self.step = step
        self.hold_file = Path(hold_file)
        self.world_size = world_size
        self.release_on_signal = release_on_signal
        self.signalled = False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step != self.step or not self.hold_file.exists():
            return
        if self.world_size is not None and trainer.world_size != self.world_size:
            return
        stops = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)
        previous = {signum: signal.getsignal(signum) for signum in stops}

        def note(signum: int, frame) -> None:
            self.signalled = self.release_on_signal
            Path(f"{self.hold_file}.signalled.rank{trainer.global_rank}").touch()
            if callable(previous[signum]):
                previous[signum](signum, frame)

        for signum in previous:
            signal.signal(signum, note)
        Path(f"{self.hold_file}.rank{trainer.global_rank}").touch()
        try:
            while self.hold_file.exists() and not self.signalled:
                time.sleep(0.02)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)


class HoldWhileStarting(DDPStrategy):
    """training.DDPStrategy holding every process of the job at a point of its start, so a test can signal it there
    however fast the machine starts: ``at="launched"`` once Lightning has started the node's processes, before the
    start-up handshake; ``at="set_up"`` once the strategy is set up (checkpoint loaded, model wrapped), before
    Lightning registers its signal handlers.

    Each process writes ``<hold_file>.rank<N>`` (N its local rank) when it holds, then waits until ``hold_file`` is
    gone.
    """

    def __init__(self, *args, hold_file: str, at: Literal["launched", "set_up"] = "launched", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.hold_file = Path(hold_file)
        self.at = at

    def setup_environment(self) -> None:
        if self.at == "launched":
            self.hold()
        super().setup_environment()

    def setup(self, trainer: Trainer) -> None:
        super().setup(trainer)
        if self.at == "set_up":
            self.hold()

    def hold(self) -> None:
        hold_while(self.hold_file, self.local_rank)


class HoldAtTeardown(Callback):
    """Holds every process in the ``teardown`` hook of a run that ended well, where Lightning has put back the signal
    handlers it found: writes ``<hold_file>.rank<N>`` (N its local rank), then waits until ``hold_file`` is gone."""

    def __init__(self, hold_file: str) -> None:
        self.hold_file = Path(hold_file)

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        hold_while(self.hold_file, trainer.local_rank)


class HoldInSanityCheck(Callback):
    """Holds every process in the first batch of the sanity check, after Lightning registered its signal handlers and
    before training (with ``epoch``, in the first batch of that epoch's validation instead): writes
    ``<hold_file>.rank<N>`` (N its local rank), then waits until ``hold_file`` is gone."""

    def __init__(self, hold_file: str, epoch: int | None = None) -> None:
        self.hold_file = Path(hold_file)
        self.epoch = epoch

    def on_validation_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        in_epoch = not trainer.sanity_checking and trainer.current_epoch == self.epoch and batch_idx == 0
        if trainer.sanity_checking if self.epoch is None else in_epoch:
            hold_while(self.hold_file, trainer.local_rank)


def hold_while(hold_file: Path, local_rank: int) -> None:
    Path(f"{hold_file}.rank{local_rank}").touch()
    while hold_file.exists():
        time.sleep(0.02)


class HoldInSave(Callback):
    """Holds global rank ``rank`` inside ``on_save_checkpoint`` while ``hold_file`` exists, as a slow save would;
    writes ``<hold_file>.held`` when it starts holding. The other ranks wait for it in the next collective."""

    def __init__(self, rank: int, hold_file: str) -> None:
        self.rank = rank
        self.hold_file = Path(hold_file)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict) -> None:
        if trainer.global_rank != self.rank or not self.hold_file.exists():
            return
        Path(f"{self.hold_file}.held").touch()
        while self.hold_file.exists():
            time.sleep(0.02)


class MetricProbe(Callback):
    """Saves the metrics of the latest validation run as ``metrics.pt`` in ``out_dir``, from global rank 0."""

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.is_global_zero and not trainer.sanity_checking:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            metrics = {name: float(value) for name, value in trainer.callback_metrics.items()}
            torch.save(metrics, self.out_dir / "metrics.pt")


class OptimizerStepProbe(Callback):
    """Records, for every optimizer step, the batches it took and the gradient norm before and after clipping.

    Lightning runs forward, backward, ``on_before_optimizer_step`` and then clipping inside ``optimizer.step``;
    the optimizer's post-hook sees the gradients the update used.
    """

    def __init__(self) -> None:
        self.batches_per_step: list[int] = []
        self.norms_before_clipping: list[float] = []
        self.norms_used: list[float] = []
        self.batches_since_step = 0

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for optimizer in trainer.optimizers:
            optimizer.register_step_post_hook(self.record_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.batches_since_step += 1

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Optimizer) -> None:
        self.norms_before_clipping.append(gradient_norm(optimizer))

    def record_step(self, optimizer: Optimizer, args: tuple, kwargs: dict) -> None:
        self.norms_used.append(gradient_norm(optimizer))
        self.batches_per_step.append(self.batches_since_step)
        self.batches_since_step = 0


def gradient_norm(optimizer: Optimizer) -> float:
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return float(torch.nn.utils.get_total_norm(grads))


class TokenRate(Callback):
    """Writes ``tokens.json`` in ``out_dir`` from global rank 0: the non-padding tokens its seq2seq batches held
    after the first step, the seconds of training they took (the first step, with its set-up, and validation are
    left out) and the world size.
    """

    def __init__(self, out_dir: str) -> None:
        self.out_dir = Path(out_dir)
        self.tokens: torch.Tensor | int = 0
        self.seconds = 0.0
        self.started: float | None = None

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step < 1:
            return
        if self.started is None:
            self.synchronize(pl_module)
            self.started = time.perf_counter()
        # Summed on the device: reading a count back every step would slow down what is measured.
        self.tokens = self.tokens + (~batch["source_padding_mask"]).sum() + (~batch["target_padding_mask"]).sum()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.pause(pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self.pause(pl_module)
        if trainer.is_global_zero:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            record = {"tokens": int(self.tokens), "seconds": self.seconds, "world_size": trainer.world_size}
            (self.out_dir / "tokens.json").write_text(json.dumps(record))

    def pause(self, pl_module: LightningModule) -> None:
        if self.started is not None:
            self.synchronize(pl_module)
            self.seconds += time.perf_counter() - self.started
            self.started = None

    @staticmethod
    def synchronize(pl_module: LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)


WRITES_RELEASED = threading.Event()


class SavesAfterTrainingEnds(AtomicCheckpointIO):
    """Background checkpoint writes that cannot finish before training has ended (``ReleaseSaves`` lets them go)."""

    def __init__(self) -> None:
        super().__init__(background=True)
        WRITES_RELEASED.clear()

    def write(self, checkpoint: dict, path: str) -> None:
        WRITES_RELEASED.wait(timeout=600)
        super().write(checkpoint, path)


class ReleaseSaves(Callback):
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        WRITES_RELEASED.set()


class SlowLoader(Callback):
    """Slows the training data loader of the nodes in ``nodes`` by ``seconds`` per batch, as a loader short of
    workers or CPU cores would be: the dataset sleeps before each batch it hands to the loader."""

    def __init__(self, seconds: float, nodes: list[int]) -> None:
        self.seconds = seconds
        self.nodes = nodes

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dataset = trainer.train_dataloader.dataset
        if trainer.node_rank not in self.nodes or "__getitems__" in vars(dataset):
            return
        fetch = dataset.__getitems__  # the loader's fetcher looks it up on the dataset object

        def slowed(indices: list[int]):
            time.sleep(self.seconds)
            return fetch(indices)

        dataset.__getitems__ = slowed


class CudaSyncCount(Callback):
    """Counts the calls of ``torch.cuda.synchronize`` in training steps (from this callback's
    ``on_train_batch_start`` to its ``on_train_batch_end``, which runs after those of the config's callbacks) and
    writes them to ``out`` (JSON) at the end, with the clocks training.StepTime timed the steps with."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.calls = 0
        self.in_step = False
        self.synchronize = torch.cuda.synchronize

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        def counted(*args, **kwargs):
            self.calls += self.in_step
            return self.synchronize(*args, **kwargs)

        torch.cuda.synchronize = counted

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch, batch_idx: int) -> None:
        self.in_step = True

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self.in_step = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        torch.cuda.synchronize = self.synchronize
        from training import StepTime

        clocks = [type(c.clock).__name__ for c in trainer.callbacks if isinstance(c, StepTime)]
        self.out.write_text(json.dumps({"synchronize_calls": self.calls, "clocks": clocks}))
