"""Save the run's last checkpoint when the job is told to stop (SIGTERM, SLURM's SIGUSR1, Ctrl-C, a closed terminal)."""

import logging
import signal
import threading
import time

import torch
import torch.distributed as dist
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from training.checkpoints.resume import last_checkpoint_path
from training.job.early import STOP_SIGNALS, not_ignored
from training.job.node_processes import speaks_for_node
from training.job.stop_signal import EXIT_STATUS, REQUESTS, URGENCY, cause
from training.private_api import stop_sigterm_broadcast

SIGNALS = (*STOP_SIGNALS, signal.SIGUSR1)
# About how often, in seconds of training, the ranks agree on whether to stop.
CHECK_PERIOD = 1.0


class PreemptionCheckpoint(Callback):
    """Stops every rank after the same training batch when a stop signal arrives, with ``last.ckpt`` saved there.

    The signal handler (training/job/stop_signal.py) only notes the request (and passes SIGTERM on to the
    processes Lightning started on this node). About once a second of training, after the same batch on every
    rank, the ranks agree with a two-number all-reduce on a CPU (gloo) channel whether any of them was asked
    to stop, by which signal, on which node, and when to agree next; if so, all raise Lightning's
    ``SIGTERMException`` together, this callback saves the checkpoint, every node says so, and the process exits:
    with status 0 after SIGTERM or SIGUSR1 (a scheduler's stop), 130 after Ctrl-C and 129 after SIGHUP (a closed
    terminal). A second Ctrl-C stops at once. A stop requested during validation takes effect after the next
    agreement in training.

    This replaces Lightning's own SIGTERM handling: its handler runs a broadcast inside the signal handler,
    which the ranks reach at unrelated points of their step, so it can pair with another rank's gradient
    all-reduce and hang the job; and its loop broadcasts a flag after every batch, which costs a short step
    a tenth of its time on gloo. SIGUSR1, which SLURM sends ahead of a time limit or preemption
    (``#SBATCH --signal``), is handled the same way, which also keeps Lightning's SLURM handler from writing
    a second checkpoint elsewhere.
    """

    def __init__(self) -> None:
        self._stopped_by: int | None = None
        self._stopped_on: int | None = None  # the node the signal reached, where it reached one node only
        self._channel: dist.ProcessGroup | None = None
        self._previous_handlers: dict[int, signal.Handlers] = {}
        self._since_check = self._check_every = 0  # batches since the last agreement; agree after this many
        self._last_check = 0.0

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.world_size > 1 and dist.get_backend() != "gloo":
            self._channel = dist.new_group(backend="gloo")  # no GPU synchronisation for a flag

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._since_check = self._check_every = 0
        self._last_check = time.monotonic()
        if not stop_sigterm_broadcast(trainer):  # redundant with the agreement below
            rank_zero_warn("Lightning's per-batch SIGTERM broadcast has moved; it stays on and costs some speed.")
        # After Lightning registered its handlers, which it restores when the run ends.
        if threading.current_thread() is threading.main_thread():
            # A SIGTERM since the run started (its sanity check) was noted by Lightning's handler.
            REQUESTS.arm(trainer, noted=signal.SIGTERM if trainer.received_sigterm else None)
            for signum in not_ignored(SIGNALS):
                self._previous_handlers[signum] = signal.signal(signum, REQUESTS.handle)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        self._since_check += 1
        if self._since_check < self._check_every:
            return
        # The next agreement about CHECK_PERIOD from now at this rank's pace; the ranks run in step, so
        # their proposals hardly differ, and the largest is taken. The pace of the first batches is no guide
        # (the first is timed without the work other callbacks do after this one, or with set-up work in it),
        # so the period at most doubles from one agreement to the next.
        now = time.monotonic()
        seconds_per_batch = (now - self._last_check) / self._since_check
        paced = round(CHECK_PERIOD / max(seconds_per_batch, 1e-6))
        proposal = max(1, min(1000, 2 * max(self._check_every, 1), paced))
        # The lowest and highest node rank asked to stop (0 where none): one node, if they are the same.
        node = trainer.node_rank + 1 if REQUESTS.received is not None else 0
        flags = torch.tensor([URGENCY.index(REQUESTS.received), proposal, node, -node if node else -(1 << 30)])
        if trainer.world_size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self._channel)
        self._last_check, self._since_check, self._check_every = now, 0, int(flags[1])
        if flags[0]:
            self._stopped_by = URGENCY[int(flags[0])]
            self._stopped_on = int(flags[2]) - 1 if trainer.num_nodes > 1 and flags[2] == -flags[3] else None
            raise SIGTERMException(EXIT_STATUS[self._stopped_by])

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # After an exception, Lightning's teardown restores what it found before the run instead.
        for signum, handler in self._previous_handlers.items():
            signal.signal(signum, handler)
        self._previous_handlers.clear()
        REQUESTS.disarm()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException) or trainer.checkpoint_callback is None:
            return
        path = last_checkpoint_path(trainer)
        trainer.checkpoint_callback.last_model_path = str(path)
        trainer.save_checkpoint(path, weights_only=False)
        if not speaks_for_node():
            return
        # A progress bar leaves its line open: the paragraph starts on a line of its own.
        bar = trainer.progress_bar_callback
        sent = f" to node {self._stopped_on}" if self._stopped_on is not None else ""
        every = " on every node" if trainer.num_nodes > 1 else ""
        logging.getLogger("lightning.pytorch").info(
            ("\n" if bar is not None and bar.is_enabled else "")
            + f"Stopped by {cause(self._stopped_by) if self._stopped_by else 'a signal'}{sent} at epoch "
            f"{trainer.current_epoch}, step {trainer.global_step}: saved {path}. "
            f"Run the same command again{every} to resume from there."
        )
