"""A stalled process: alive, its heartbeat fine, but making no progress in training while the others wait for it in a
collective (a DataLoader that blocks, a worker deadlocked at fork, a dataset on a dead network mount, a hung call in
the module's own step).

Every process adds to its heartbeat how far it has got (training batches fetched), what it is doing, how long it has
made no progress and, once that is long, where its main thread is: its Python stack, which another thread can read
while the main thread waits in C. training/heartbeat/liveness.py names a stalled process in every node's log after
``stall_report`` and stops the job after ``stall_timeout``; a process that saves a checkpoint or validates meanwhile is
busy, not stalled, and the others' logs say so.
"""

import time
from collections.abc import Callable
from typing import Any

from lightning.pytorch import Trainer

from training.private_api import main_thread_stack

# Frames of a process that waits for the others: a collective, or DDP's gradient all-reduce inside backward.
WAITING = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")
SAVING = ("torch/serialization.py", "save_checkpoint")
STACK_FRAMES = 12


class Activity:
    """This process's progress for its heartbeat: ``trainer`` returns the running Trainer, or None before it runs;
    the stack is added once no progress was made for ``stack_after`` seconds (0: never)."""

    def __init__(self, trainer: Callable[[], Trainer | None], stack_after: float) -> None:
        self.trainer = trainer
        self.stack_after = stack_after
        self.last: tuple[int, str] | None = None
        self.changed = time.monotonic()

    def __call__(self) -> dict[str, Any]:
        trainer = self.trainer()
        if trainer is None or trainer.state.stage is None:
            return {}
        now = time.monotonic()
        progress = (trainer.fit_loop.epoch_loop.batch_progress.total.ready, trainer.state.stage.value)
        if progress != self.last:
            self.last, self.changed = progress, now
        quiet = now - self.changed
        activity = {"batches": progress[0], "stage": progress[1], "quiet": round(quiet, 1)}
        activity |= {"epoch": trainer.current_epoch, "step": trainer.global_step}
        if self.stack_after and quiet >= self.stack_after:
            activity["stack"] = main_thread_stack(STACK_FRAMES)
        return activity


def doing(beat: dict[str, Any]) -> str:
    """What a process that made no progress does: waiting for the others, saving, validating, or training."""
    stack = "".join(beat.get("stack", []))
    if any(place in stack for place in SAVING):
        return "saving a checkpoint"
    if beat.get("stage") != "train":
        return {"validate": "validating", "sanity_check": "running the sanity check"}.get(beat.get("stage"), "busy")
    if any(place in stack for place in WAITING):
        return "waiting"
    return "training"


def stalled(beats: dict[int, dict[str, Any]], seconds: float) -> dict[int, str]:
    """The processes of the job (rank -> what it does) that have made no progress for ``seconds`` while another
    waits for them: behind the others in batches, or in the same batch but not waiting where another waits. A stalled
    process is "training"; one saving or validating is only busy."""
    if len(beats) < 2 or not all("batches" in beat for beat in beats.values()):
        return {}
    what = {rank: doing(beat) for rank, beat in beats.items()}
    found = {}
    for rank, beat in beats.items():
        if beat["quiet"] < seconds or "stack" not in beat or what[rank] == "waiting":
            continue
        others = [other for other in beats if other != rank]
        if any(beats[other]["batches"] > beat["batches"] or what[other] == "waiting" for other in others):
            found[rank] = what[rank]
    return found


def where_it_waits(beat: dict[str, Any]) -> str:
    """The innermost frame of a process's stack: ``function (file:line)``."""
    stack = beat.get("stack") or []
    if not stack:
        return "somewhere its stack does not show"
    first = stack[-1].strip().splitlines()[0]  # File "...", line N, in name
    try:
        path, line, name = first.split(", ")
        return f"{name.removeprefix('in ')} ({path.removeprefix('File ').strip(chr(34))}:{line.removeprefix('line ')})"
    except ValueError:
        return first
