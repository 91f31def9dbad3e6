"""Processes that formed a process group leave it without hanging: the ranks of benchmarks/raw_ddp.py and of the
doctor, each exit run many times over with the other core busy. Freed in the wrong order, a gloo group's last
reference went with the GIL held while its worker thread needed the GIL, and the process hung."""

import argparse
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from tests.helpers import DDP_YAML, free_port
from tests.timeout_stacks import stacks_of_children

# Rounds of each exit: the raw loop's old order hung well within 20 on a loaded machine, so it keeps them all; the
# doctor's ranks, which wait for their collectives before the group goes, get 10.
RAW_LOOPS = 20
DOCTOR_LOOPS = 10
# A hung exit never ends; a healthy one ends in seconds, even on a loaded machine.
EXIT_BOUND = 120


@pytest.fixture(scope="module")
def busy_core():
    """A process spinning on one core while the other runs the exits: a hang showed on a loaded machine. At the
    lowest priority it takes only the CPU nothing else wants: alone it loads a core as before, in the whole suite it
    leaves the other tests' processes theirs."""
    spinner = subprocess.Popen([sys.executable, "-c", "import os; os.nice(19)\nwhile True: pass"])
    yield
    spinner.kill()
    spinner.wait()


def exit_many_times(function, arguments, loops: int) -> None:
    """Run ``function(rank, *arguments(loop))`` on 2 forked processes ``loops`` times, each time until both exited."""
    for loop in range(loops):
        context = mp.start_processes(function, args=arguments(loop), nprocs=2, start_method="fork", join=False)
        deadline = time.monotonic() + EXIT_BOUND
        while not context.join(timeout=max(0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                stacks = stacks_of_children()
                for process in context.processes:
                    process.kill()
                pytest.fail(f"exit {loop + 1} of {loops}: the ranks did not end within {EXIT_BOUND} s\n{stacks}")


def raw_rank(rank: int, port: int) -> None:
    """A rank of benchmarks/raw_ddp.py's loop on a tiny model, a few steps, then its way out."""
    from benchmarks import raw_ddp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 4))
    sampler = DistributedSampler(data, num_replicas=2, rank=rank)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(data, batch_size=8, sampler=sampler)
    raw_ddp.timed_steps(model, torch.device("cpu"), loader, sampler, raw_ddp.toy_loss, optimizer, None, 3)
    raw_ddp.release_group()


@pytest.mark.distributed
def test_the_raw_loop_ends_every_time(busy_core):
    exit_many_times(raw_rank, lambda loop: (free_port(),), RAW_LOOPS)


@pytest.mark.distributed
def test_the_doctors_processes_end_every_time(busy_core, tmp_path, monkeypatch):
    from scripts.doctor import process
    from training.job.fingerprint import config_items

    config = config_items(yaml.safe_load(Path(DDP_YAML).read_text()))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    args = argparse.Namespace(node_rank=0, num_nodes=1, nproc=2, accelerator="cpu", timeout=60, bench=False)

    def arguments(loop: int) -> tuple:
        monkeypatch.setenv("MASTER_PORT", str(free_port()))  # read by the forked processes
        return args, config, mp.get_context("fork").Event()

    exit_many_times(process, arguments, DOCTOR_LOOPS)
