"""The order in which a training process lets go of its process group as it ends (training/strategy.py).

Two processes on gloo run the end of a training process many times in a loop: a DDP wrapper that just reduced
its gradients, then ``leave_process_group`` as the process's exit runs it: once with the wrapper already gone (as
Lightning's teardown leaves it), once with the wrapper still held (as by the traceback of an error in its forward),
freed only afterwards. The other order, the group destroyed while the wrapper lives, hangs one of the processes
for good within a few rounds: the wrapper's Reducer, freed with the GIL held, drops the group's last reference, and
the group's destructor waits for a gloo worker thread that needs the GIL.
"""

import datetime
import gc
import multiprocessing
import time
import weakref
from pathlib import Path

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.distributed

ROUNDS = 8
HANG_GUARD = 240  # seconds for all rounds: a round takes well under a second, a hang forever


def end_of_training(rank: int, port: int, progress: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from training.strategy import leave_process_group

    gc.freeze()  # as cli.py does after its imports: a collection at exit skips what they made
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=60))
    for round_ in range(ROUNDS):
        for held in (False, True):
            dist.init_process_group("gloo", store=dist.PrefixStore(f"{round_}{held}", store), rank=rank, world_size=2)
            wrapper = DistributedDataParallel(torch.nn.Linear(16, 16))
            holder = [wrapper] if held else []
            alive = weakref.ref(wrapper)
            for _ in range(2):
                wrapper(torch.randn(4, 16)).sum().backward()
            del wrapper
            leave_process_group(alive)  # at once: gloo's worker may still be freeing the last all-reduce
            holder.clear()  # a held wrapper goes now, as at the end of the interpreter
            if dist.is_initialized():
                dist.destroy_process_group()
            Path(progress).write_text(f"{round_} {held}")


def test_a_process_group_is_let_go_in_an_order_that_cannot_hang(tmp_path):
    spawn = multiprocessing.get_context("spawn")
    port = free_port()
    processes = [
        spawn.Process(target=end_of_training, args=(rank, port, str(tmp_path / f"rank{rank}"))) for rank in range(2)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + HANG_GUARD
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
    for process in processes:
        process.kill()
    reached = [(tmp_path / f"rank{rank}").read_text() if (tmp_path / f"rank{rank}").exists() else "" for rank in (0, 1)]
    assert not hung, f"rank {hung} hung; the ranks had reached (round, held): {reached}"
    assert [process.exitcode for process in processes] == [0, 0]
    assert reached == [f"{ROUNDS - 1} True"] * 2
