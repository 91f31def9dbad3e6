"""What a process forked from a rank inherits (training/job/forked.py): a DataLoader worker, of any loader, leaves the
stop signals to its rank, but ends on its rank's own SIGTERM, as torch and multiprocessing end workers, and tells its
rank where it is when asked (a stall report: one that reads or starts by its stack, one that cannot answer by its pid,
an idle one not at all); a pool of the module's own keeps the signals' usual effect, which ``Pool.terminate`` relies
on."""

import json
import os
import re
import signal
import subprocess
import sys

from tests.helpers import REPO
from training.heartbeat.stall import SILENT

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

# Each child reports its pid, the signals it blocks (SigBlk in /proc) and its parent-death signal (PR_GET_PDEATHSIG);
# then the worker serves one more batch per line on standard input, and the script exits at its end, which
# multiprocessing does by sending its live workers SIGTERM and waiting for them.
REPORT = """
import ctypes, json, multiprocessing, os, signal, sys, threading, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader, Dataset
from training.heartbeat.stall import WAITS_FOR_DATA, where
from training.job.forked import end_forked_with_this_process
from training.private_api import main_thread_stack

HOLD = Path(sys.argv[1])
STARTING = Path(f"{HOLD}.starting")

def report(_=None):
    blocked = next(line for line in open("/proc/self/status") if line.startswith("SigBlk:")).split()[1]
    death = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death))
    return [os.getpid(), int(blocked, 16), death.value]

class Reports(Dataset):
    def __len__(self):
        return 1000
    def __getitem__(self, index):
        while HOLD.exists():  # a read on a dead mount
            threading.Event().wait(0.01)
        return torch.tensor(report())

def hold_while_starting(worker_id):  # a worker_init_fn that connects to a dead server
    while STARTING.exists():
        threading.Event().wait(0.01)

def ask_while_waiting(asked, release, until):  # what a stall report finds once the main thread waits for a worker
    found, deadline = {}, time.monotonic() + 120  # then the test fails on what was found
    # Asked again, as each heartbeat asks, until the worker got to where it blocks: a new one is starting at first.
    while until not in found.get("place", "") and time.monotonic() < deadline:
        threading.Event().wait(0.01)
        stack = main_thread_stack(12)
        found = where(stack) if WAITS_FOR_DATA in "".join(stack) else {}
    print(json.dumps(found), flush=True)
    release()
    asked.set()

def stall(batches, release, until):
    asked = threading.Event()
    threading.Thread(target=ask_while_waiting, args=(asked, release, until)).start()
    while not asked.is_set():
        next(batches)

end_forked_with_this_process()
batches = iter(DataLoader(Reports(), num_workers=1, batch_size=None, prefetch_factor=1))
worker = next(batches).tolist()
with multiprocessing.get_context("fork").Pool(1) as pool:
    pooled = pool.apply(report)
print(json.dumps({"worker": worker, "pool": pooled, "rank": report()}), flush=True)
for line in sys.stdin:
    if line == "stall\\n":  # the worker's reads hang
        HOLD.touch()
        stall(batches, HOLD.unlink, "__getitem__")
    elif line == "starting\\n":  # another loader's worker hangs before its first read; the first one is idle
        STARTING.touch()
        starting = DataLoader(Reports(), num_workers=1, batch_size=None, worker_init_fn=hold_while_starting)
        stall(iter(starting), STARTING.unlink, "hold_while_starting")
    elif line == "stopped\\n":  # the worker stopped, as one stuck in C code that holds Python's lock is
        os.kill(worker[0], signal.SIGSTOP)
        stall(batches, lambda: os.kill(worker[0], signal.SIGCONT), "did not answer")
    else:
        print(json.dumps(next(batches).tolist()), flush=True)
"""


def asked(rank: subprocess.Popen, what: str) -> dict:
    """What the rank's stall report found, once the script above had it wait for data in the stall ``what``."""
    rank.stdin.write(f"{what}\n")
    rank.stdin.flush()
    return json.loads(rank.stdout.readline())


def blocked(mask: int) -> set[int]:
    return {signum for signum in STOPS if mask & (1 << (signum - 1))}


def test_a_dataloader_worker_leaves_stop_signals_to_its_rank_tells_it_where_it_is_and_ends_on_its_sigterm(tmp_path):
    rank = subprocess.Popen(
        [sys.executable, "-c", REPORT, str(tmp_path / "hold")],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        found = json.loads(rank.stdout.readline())
        (worker, worker_blocks, worker_death), (_, pool_blocks, pool_death) = found["worker"], found["pool"]
        assert blocked(worker_blocks) == set(STOPS), "a stop signal to the job would kill the DataLoader worker"
        assert blocked(pool_blocks) == set(), "Pool.terminate could not end its workers"
        assert blocked(found["rank"][1]) == set(), "the rank itself must take the stop signals"
        assert worker_death == pool_death == signal.SIGKILL, "a forked process would outlive its rank"
        for signum in STOPS:  # sent by someone else than the rank, as to every process of a job
            os.kill(worker, signum)
        rank.stdin.write("next\n")
        rank.stdin.flush()
        assert json.loads(rank.stdout.readline())[0] == worker, "the worker did not serve on after the signals"
        found = asked(rank, "stall")  # the worker's reads hang; the rank asks its workers where they are
        assert found.get("worker") == worker, found
        assert re.fullmatch(r"__getitem__ \(<string>:\d+\)", found["place"]), found  # not threading's wait
        assert "in __getitem__" in "".join(found["worker_stack"]) and "selectors" in "".join(found["stack"]), found
        found = asked(rank, "starting")  # the worker of that first loader is idle meanwhile, and not named
        assert found.get("worker") not in (None, worker), found
        assert re.fullmatch(r"hold_while_starting \(<string>:\d+\)", found["place"]), found
        found = asked(rank, "stopped")  # it cannot answer: named by its pid, saying so
        assert (found.get("worker"), found.get("worker_stack"), found.get("place")) == (worker, [], SILENT), found
        rank.stdin.close()  # the rank exits, and multiprocessing ends its worker with SIGTERM
        assert rank.wait(timeout=120) == 0
    finally:
        rank.kill()
