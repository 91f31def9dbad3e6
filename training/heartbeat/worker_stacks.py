"""Where a rank's DataLoader workers are, for a stall report: a rank that waits for its data shows only its own wait
(``_data_queue.get``, in selectors); what blocks is in one of its workers (a read, a ``worker_init_fn``), or a worker
that cannot answer at all (stuck in C code, or in a lock it inherited as it was forked).

A worker answers SIGURG from its rank by writing its main thread's stack into a file the rank reads
(training/job/forked.py has every DataLoader worker's signal thread answer it). SIGURG because a process that did not
ask for it ignores it: a worker started some other way (a ``spawn`` context) is never harmed by the question.
"""

import contextlib
import json
import os
import signal
import tempfile
import time
from pathlib import Path

from training.job.node_processes import DATA_WORKER
from training.private_api import main_thread_stack

ASK = signal.SIGURG
FRAMES = 12  # the innermost frames of a stack that a report shows
ANSWER_SECONDS = 0.5
# Where an idle worker waits for its rank's next indices: the line of torch's worker loop
# (torch/utils/data/_utils/worker.py) that tests/test_forked.py sees in the idle workers of torch's release.
IDLE = "index_queue.get("


def stack_file(pid: int) -> Path:
    return Path(tempfile.gettempdir()) / f"ddp-worker-stack-{pid}.json"


def answer() -> None:
    """In a worker: write its main thread's stack for its rank."""
    path = stack_file(os.getpid())
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps(main_thread_stack(FRAMES)))
    os.replace(partial, path)


def data_workers() -> list[int]:
    """The pids of this process's live DataLoader workers (by the name torch gives them); one that has ended and
    not been waited for yet could never answer."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        with contextlib.suppress(OSError, IndexError, ValueError):  # ended meanwhile
            name, fields = (entry / "stat").read_text().rsplit(")", 1)
            state, parent = fields.split()[:2]
            if int(parent) == os.getpid() and name.endswith(f"({DATA_WORKER}") and state != "Z":
                found.append(int(entry.name))
    return found


def busy_workers() -> dict[int, list[str] | None]:
    """This process's DataLoader workers that are not waiting for their next indices, by pid: the stack of each that
    answered within ANSWER_SECONDS (reading a sample, in a ``worker_init_fn``, ...), None for each that did not."""
    asked = []
    for pid in data_workers():
        with contextlib.suppress(ProcessLookupError):
            stack_file(pid).unlink(missing_ok=True)
            os.kill(pid, ASK)
            asked.append(pid)
    stacks: dict[int, list[str]] = {}
    deadline = time.monotonic() + ANSWER_SECONDS
    while asked and time.monotonic() < deadline:
        for pid in list(asked):
            with contextlib.suppress(FileNotFoundError):
                stacks[pid] = json.loads(stack_file(pid).read_text())
                stack_file(pid).unlink()
                asked.remove(pid)
        time.sleep(0.02)
    return {pid: stack for pid, stack in stacks.items() if IDLE not in "".join(stack)} | dict.fromkeys(asked)
