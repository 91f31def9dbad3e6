"""What a process forked from a rank inherits (training/job/forked.py): a DataLoader worker, of any loader, leaves the
stop signals to its rank; a pool of the module's own keeps their usual effect, which ``Pool.terminate`` relies on."""

import json
import signal
import subprocess
import sys

from tests.helpers import REPO

STOPS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)

# Each child reports the signals it blocks (SigBlk in /proc) and its parent-death signal (prctl PR_GET_PDEATHSIG).
REPORT = """
import ctypes, json, multiprocessing, signal, sys
import torch
from torch.utils.data import DataLoader, Dataset
from training.job.forked import end_forked_with_this_process

def report(_=None):
    blocked = next(line for line in open("/proc/self/status") if line.startswith("SigBlk:")).split()[1]
    death = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(death))  # PR_GET_PDEATHSIG
    return [int(blocked, 16), death.value]

class Reports(Dataset):
    def __len__(self):
        return 1
    def __getitem__(self, index):
        return torch.tensor(report())

end_forked_with_this_process()
worker = next(iter(DataLoader(Reports(), num_workers=1, batch_size=None))).tolist()
with multiprocessing.get_context("fork").Pool(1) as pool:
    pooled = pool.apply(report)
json.dump({"worker": worker, "pool": pooled, "rank": report()}, sys.stdout)
"""


def blocked(mask: int) -> set[int]:
    return {signum for signum in STOPS if mask & (1 << (signum - 1))}


def test_a_dataloader_worker_blocks_the_stop_signals_and_a_pool_worker_does_not():
    run = subprocess.run([sys.executable, "-c", REPORT], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    found = json.loads(run.stdout)
    assert blocked(found["worker"][0]) == set(STOPS), "a stop signal to the job would kill the DataLoader worker"
    assert blocked(found["pool"][0]) == set(), "Pool.terminate could not end its workers"
    assert blocked(found["rank"][0]) == set(), "the rank itself must take the stop signals"
    assert found["worker"][1] == found["pool"][1] == signal.SIGKILL, "a forked process would outlive its rank"
