"""Which process of a job is stalled, from the heartbeats every process sends (training/heartbeat/stall.py), and what
the node logs say of it."""

import threading
import time
from datetime import timedelta
from types import SimpleNamespace

from lightning.pytorch.trainer.states import RunningStage

from training.heartbeat import why_stopped
from training.heartbeat.stall import Activity, stalled, where_it_waits
from training.private_api import main_thread_stack

IN_DATASET = ['  File "/home/me/my_pkg/data.py", line 42, in __getitem__\n    return self.read(index)\n']
IN_FORWARD = ['  File "/home/me/my_pkg/model.py", line 7, in forward\n    return self.net(x)\n']
IN_ALL_REDUCE = ['  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 353, in backward\n']
IN_SAVE = ['  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 967, in save\n']


def beat(rank: int, batches: int, stack: list[str], quiet: float = 200.0, stage: str = "train") -> dict:
    return {
        "rank": rank, "local": rank, "pid": 4200 + rank, "node": 0, "host": "gpu-a", "address": "10.0.0.1",
        "batches": batches, "stage": stage, "quiet": quiet, "epoch": 0, "step": batches - 1, "stack": stack,
    }  # fmt: skip


def test_a_process_behind_the_others_that_made_no_progress_is_stalled_in_training():
    beats = {0: beat(0, 5, IN_ALL_REDUCE), 1: beat(1, 4, IN_DATASET), 2: beat(2, 5, IN_ALL_REDUCE)}
    assert stalled(beats, 120) == {1: "training"}
    assert where_it_waits(beats[1]) == "__getitem__ (/home/me/my_pkg/data.py:42)"


def test_a_process_stuck_in_its_own_step_while_the_others_wait_in_the_all_reduce_is_stalled():
    beats = {0: beat(0, 5, IN_ALL_REDUCE), 1: beat(1, 5, IN_FORWARD)}
    assert stalled(beats, 120) == {1: "training"}


def test_a_process_that_saves_or_validates_is_busy_not_stalled():
    assert stalled({0: beat(0, 5, IN_SAVE), 1: beat(1, 5, IN_ALL_REDUCE)}, 120) == {0: "saving a checkpoint"}
    validating = {0: beat(0, 5, IN_FORWARD, stage="validate"), 1: beat(1, 5, IN_ALL_REDUCE)}
    assert stalled(validating, 120) == {0: "validating"}


def test_nobody_is_stalled_before_the_time_or_while_all_wait_or_progress():
    assert stalled({0: beat(0, 5, IN_ALL_REDUCE, quiet=100), 1: beat(1, 4, IN_DATASET, quiet=100)}, 120) == {}
    assert stalled({0: beat(0, 5, IN_ALL_REDUCE), 1: beat(1, 5, IN_ALL_REDUCE)}, 120) == {}
    assert stalled({0: beat(0, 5, IN_FORWARD), 1: beat(1, 5, IN_FORWARD)}, 120) == {}
    assert stalled({0: beat(0, 5, IN_DATASET)}, 120) == {}


def test_every_node_logs_the_stalled_process_with_its_stack_and_what_follows():
    report = why_stopped.stall_report(beat(1, 4, IN_DATASET), "training", timedelta(minutes=5), timedelta(minutes=30))
    assert report.startswith(
        "warning: rank 1 (local rank 1, pid 4201) of node 0 (gpu-a, 10.0.0.1) has made no progress in training for "
        "200 s (at epoch 0, step 3), while the other processes wait for it in a collective. Its main thread is at:\n"
        '  File "/home/me/my_pkg/data.py", line 42, in __getitem__\n    return self.read(index)\n'
    )
    assert report.endswith("stops once it has made none for trainer.strategy.init_args.stall_timeout (0:05:00).")
    waits = why_stopped.stall_report(beat(1, 4, IN_DATASET), "training", timedelta(0), timedelta(minutes=30))
    assert waits.endswith("The job waits for it up to the collective timeout (0:30:00; stall_timeout is 0).")
    busy = why_stopped.stall_report(beat(0, 5, IN_SAVE), "saving a checkpoint", timedelta(0), timedelta(minutes=30))
    assert busy == (
        "note: rank 0 (local rank 0, pid 4200) of node 0 (gpu-a, 10.0.0.1) has been saving a checkpoint for 200 s "
        "(at epoch 0, step 4); the other processes wait for it."
    )


def test_a_process_tells_its_progress_and_once_it_stopped_making_any_where_its_main_thread_is():
    loop = SimpleNamespace(epoch_loop=SimpleNamespace(batch_progress=SimpleNamespace(total=SimpleNamespace(ready=3))))
    trainer = SimpleNamespace(
        fit_loop=loop, state=SimpleNamespace(stage=RunningStage.TRAINING), current_epoch=0, global_step=3
    )
    activity = Activity(lambda: trainer, stack_after=0.2)
    first = activity()
    assert first["batches"] == 3 and first["stage"] == "train" and first["quiet"] < 0.2 and "stack" not in first
    time.sleep(0.3)
    assert "in test_a_process_tells_its_progress" in "".join(activity()["stack"])
    loop.epoch_loop.batch_progress.total.ready = 4
    assert "stack" not in activity()
    assert Activity(lambda: None, 0.2)() == {}


def test_the_main_threads_stack_is_read_from_another_thread():
    found = []
    reader = threading.Thread(target=lambda: found.extend(main_thread_stack(12)))
    reader.start()
    reader.join()
    assert "test_the_main_threads_stack_is_read_from_another_thread" in "".join(found)
