"""The run's directory failing under a running job: deleted (by hand, a clean-up job) or on a disk that filled up.

The process that meets it (global rank 0, which writes the logs and checkpoints) stops the whole job with one
paragraph (training/heartbeat/verdicts.py composes it, training/strategy.py stops the job), which every node prints.
A checkpoint the disk had no room for has its own paragraph (training/checkpoints/atomic_io.py).
"""

import errno
import os
import threading
import traceback

from lightning.pytorch import Trainer

from training.heartbeat import why_stopped
from training.run.storage import is_remote, parent, shown

FULL = (errno.ENOSPC, errno.EDQUOT)
# Who writes into the run's directory, by a part of the path of their source files.
WRITERS = {
    "tensorboard": "TensorBoard",
    "csv_logs": "the CSV logger",
    "mlflow": "MLflow",
    "run/record": "the run's config.yaml",
    "checkpoint": "a checkpoint save",
}


def run_of(trainer: Trainer | None) -> str | None:
    """The run's directory, where its checkpoints are kept, once the checkpoint callback knows it (None before its
    setup, or without one). Only reads what is set: it runs as the job fails."""
    dirpath = getattr(trainer.checkpoint_callback, "dirpath", None) if trainer is not None else None
    return parent(str(dirpath)) if dirpath else None


def os_error(error: BaseException) -> OSError | None:
    """``error`` if an OSError, else the OSError it was raised from: Lightning's TensorBoardLogger turns any error of
    a write into a ValueError ("you tried to log ... which is currently not supported")."""
    seen = 0
    while error is not None and not isinstance(error, OSError) and seen < 5:
        error, seen = error.__cause__ or error.__context__, seen + 1
    return error if isinstance(error, OSError) else None


def is_full_disk(error: OSError | None) -> bool:
    return error is not None and error.errno in FULL


def is_deleted(error: OSError | None, run: str | None) -> bool:
    """Whether ``error`` is a file of the run's directory ``run`` not found because the directory is gone."""
    missing = error is not None and error.errno == errno.ENOENT
    return missing and run is not None and not is_remote(run) and not os.path.isdir(run)


def writer(error: BaseException) -> str:
    """Who was writing when ``error`` came: a logger or a save, from the innermost frame of one of theirs."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        for part, name in WRITERS.items():
            if part in frame.filename:
                return name
    return "this process"


def deleted(run: str, error: BaseException, reached: str, command: str) -> str:
    """``reached``: where this node had got to, a sentence ("" before training)."""
    return (
        f"the run's directory {shown(run)} was deleted while the job trained: {writer(error)} could not write there "
        f"({why_stopped.one_line(error)}). Its checkpoints went with it, so nothing is left to resume from. "
        f"{reached + ' ' if reached else ''}Running the same command on every node again starts the run anew, from "
        f"the first step (set RUN_ID to a new name to tell the two apart){why_stopped.STARTED}{command}"
    )


def full_disk(run: str, error: BaseException, tail: str) -> str:
    return (
        f"the disk of the run's directory {shown(run)} is full: {writer(error)} could not write there "
        f"({why_stopped.one_line(error)}). Free space on it (or give the logger's save_dir another disk), then resume. "
        f"{tail}"
    )


# With one process no strategy stops a job: the paragraph travels with the exception to cli.py, which prints it.
EXPLAINED = "the template's paragraph: "


def failed_run(error: BaseException, run: str | None, reached: str, command: str, tail: str) -> str | None:
    """The paragraph for ``error`` where the run's directory ``run`` was deleted or its disk filled, else None.
    ``reached``: where the process had got to, a sentence; ``tail``: where the job had got to and how to resume."""
    cause = os_error(error)
    if is_deleted(cause, run):
        return deleted(run, cause, reached, command)
    if is_full_disk(cause) and run is not None:
        return full_disk(run, cause, tail)
    return None


def explain_alone(error: BaseException, trainer: Trainer) -> None:
    """Add the paragraph for ``error`` to it where the run's directory was deleted or its disk filled, in a run of
    one process (training/run/record.py); training/config/checks.py finds it there."""
    progress, command = (trainer.current_epoch, trainer.global_step), why_stopped.launch_command()
    reached = f"This run had reached epoch {progress[0]}, step {progress[1]}."
    tail = why_stopped.tail(None, progress, None, command, getattr(trainer.state.fn, "value", "fit"), nodes=1)
    if paragraph := failed_run(error, run_of(trainer), reached, command, tail):
        error.add_note(EXPLAINED + paragraph)


def explained(error: BaseException | None) -> str | None:
    """The paragraph ``explain_alone`` added to ``error``, or to the error it came in the handling of (Lightning's
    teardown writes to the same directory again, and fails again), if any."""
    for _ in range(5):
        notes = getattr(error, "__notes__", [])
        if found := next((note.removeprefix(EXPLAINED) for note in notes if note.startswith(EXPLAINED)), None):
            return found
        error = error.__context__ if error is not None else None
    return None


def quiet_writer_threads() -> None:
    """Keep TensorBoard's writer thread from printing a traceback when its write fails: it keeps the error, which its
    next write in the main thread raises, and the job stops there with one paragraph."""
    shown_by_python = threading.excepthook
    if getattr(shown_by_python, "quiets_writer_threads", False):  # every run of a process installs it
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if type(args.thread).__name__ != "_AsyncWriterThread" or not isinstance(args.exc_value, OSError):
            shown_by_python(args)

    hook.quiets_writer_threads = True
    threading.excepthook = hook
