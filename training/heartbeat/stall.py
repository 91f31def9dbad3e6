"""A stalled process: alive, its heartbeat fine, but making no progress in training, validation, test or predict while
the others wait for it in a collective (a DataLoader that blocks, a worker deadlocked at fork, a dataset on a dead
network mount, a hung call in the module's own step).

Every process adds to its heartbeat how far it has got (batches fetched, every loop's together), what it is doing, how
long it has made no progress and, once that is long, where it is: its main thread's Python stack, which another
thread can read while the main thread waits in C, and where that waits for its data, the stack of a DataLoader
worker that is not waiting for indices, or the pid of one that did not answer (training/heartbeat/worker_stacks.py).
training/heartbeat/liveness.py names a stalled process in every node's log after ``stall_report`` and stops the job
after ``stall_timeout``; a process that saves a checkpoint meanwhile is busy, not stalled, and the others' logs say
so.
"""

import os
import re
import sysconfig
import time
from collections.abc import Callable
from typing import Any

import lightning
import torch
from lightning.pytorch import Trainer

from training.heartbeat import worker_stacks
from training.job.forked import REGISTRATION
from training.private_api import main_thread_stack

# Frames of a process that waits for the others: a collective, or DDP's gradient all-reduce inside backward.
WAITING = ("torch/distributed/", "torch/autograd/", "torch/nn/parallel/distributed.py")
SAVING = ("torch/serialization.py", "save_checkpoint")
SAVING_A_CHECKPOINT = "saving a checkpoint"
# A main thread that waits for its DataLoader's workers.
WAITS_FOR_DATA = "torch/utils/data/dataloader.py"
# Where a DataLoader worker that did not answer is: its signal thread, which answers, did not get to run.
SILENT = (
    f"a place it did not say (it did not answer within {worker_stacks.ANSWER_SECONDS} s: stopped, or blocked in C code "
    "that holds Python's lock, such as a lock it inherited as it was forked: docs/versions.md names the Pythons that "
    "do that)"
)
STAGES = {
    "train": "training",
    "sanity_check": "the sanity check",
    "validate": "validation",
    "test": "testing",
    "predict": "prediction",
}
# Where the innermost frame of the user's own code is looked for: not in Python's library, torch's or Lightning's.
LIBRARIES = tuple(
    {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]}
    | {os.path.dirname(package.__file__) for package in (torch, lightning)}
)
FRAME = re.compile(r'\s*File "(.*)", line (\d+), in (.*)')


def loops(trainer: Trainer) -> list[Any]:
    """Every loop of ``trainer`` that fetches batches: training, the fit's validation, validate, test, predict."""
    epoch = trainer.fit_loop.epoch_loop
    return [epoch, epoch.val_loop, trainer.validate_loop, trainer.test_loop, trainer.predict_loop]


class Activity:
    """This process's progress for its heartbeat: ``trainer`` returns the running Trainer, or None before it runs;
    where it is is added once no progress was made for ``stack_after`` seconds (0: never)."""

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
        progress = (sum(loop.batch_progress.total.ready for loop in loops(trainer)), trainer.state.stage.value)
        if progress != self.last:
            self.last, self.changed = progress, now
        quiet = now - self.changed
        run = trainer.state.fn.value
        activity = {"batches": progress[0], "stage": progress[1], "quiet": round(quiet, 1), "run": run}
        activity |= {"epoch": trainer.current_epoch, "step": trainer.global_step}
        if run != "fit":  # validate, test or predict: how many batches it has read
            activity["read"] = getattr(trainer, f"{run}_loop").batch_progress.total.ready
        if self.stack_after and quiet >= self.stack_after:
            activity |= where(main_thread_stack(worker_stacks.FRAMES))
        return activity


def where(stack: list[str]) -> dict[str, Any]:
    """Where a process is, for its heartbeat: its main thread's ``stack``, and where that waits for data, the stack of
    a DataLoader worker that is busy (reading, starting), or else the pid of one that did not answer (an empty
    ``worker_stack``); the innermost frame of the user's code there (``place``)."""
    found: dict[str, Any] = {"stack": stack, "place": own_frame(stack)}
    if REGISTRATION.registered and WAITS_FOR_DATA in "".join(stack):
        workers = worker_stacks.busy_workers()
        for pid, worker_stack in sorted(workers.items(), key=lambda item: item[1] is None):  # those that answered first
            place = own_frame(worker_stack) if worker_stack is not None else SILENT
            return found | {"worker": pid, "worker_stack": worker_stack or [], "place": place}
    return found


def own_frame(stack: list[str]) -> str:
    """The innermost frame of ``stack`` outside Python's library, torch and Lightning (or else the innermost):
    ``function (file:line)``."""
    frames = [match.groups() for entry in stack if (match := FRAME.match(entry))]
    for path, line, name in reversed(frames):
        if not path.startswith(LIBRARIES):
            return f"{name} ({path}:{line})"
    return f"{frames[-1][2]} ({frames[-1][0]}:{frames[-1][1]})" if frames else "somewhere its stack does not show"


def doing(beat: dict[str, Any]) -> str:
    """What a process that made no progress does: saving, waiting for the others, or its stage's work."""
    stack = "".join(beat.get("stack", []))
    if any(place in stack for place in SAVING):
        return SAVING_A_CHECKPOINT
    if any(place in stack for place in WAITING):
        return "waiting"
    return STAGES.get(beat.get("stage"), "its run")


def stalled(beats: dict[int, dict[str, Any]], seconds: float) -> dict[int, str]:
    """The processes of the job (rank -> what it does) that have made no progress for ``seconds`` while another
    waits for them: behind the others in batches, or in the same batch but not waiting where another waits. One that
    saves a checkpoint is only busy (SAVING_A_CHECKPOINT)."""
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
