"""Which process of a job is stalled, in training, validation, test or predict, from the heartbeats every process sends
(training/heartbeat/stall.py), and what the node logs say of it."""

import multiprocessing
import os
import signal
import sys
import sysconfig
import threading
import time
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import RunningStage, TrainerFn

from tests.helpers.one_node import wait_gone
from training.heartbeat import why_stopped, worker_stacks
from training.heartbeat.stall import SILENT, Activity, own_frame, stalled
from training.job.forked import exit_at_once
from training.job.launched import PRCTL
from training.private_api import main_thread_stack

IN_DATASET = ['  File "/home/me/my_pkg/data.py", line 42, in __getitem__\n    return self.read(index)\n']
IN_FORWARD = ['  File "/home/me/my_pkg/model.py", line 7, in forward\n    return self.net(x)\n']
IN_ALL_REDUCE = ['  File "/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", line 353, in backward\n']
IN_SAVE = ['  File "/venv/lib/python3.11/site-packages/torch/serialization.py", line 967, in save\n']


STDLIB, TORCH = sysconfig.get_paths()["stdlib"], os.path.dirname(torch.__file__)  # as a stack shows them here
IN_WAIT = [f'  File "{STDLIB}/threading.py", line 327, in wait\n    gotit = waiter.acquire(True, timeout)\n']
IN_LOADER = [
    f'  File "{TORCH}/utils/data/dataloader.py", line 1285, in _get_data\n',
    f'  File "{STDLIB}/selectors.py", line 415, in select\n',
]
# Set as a fork begins: the before-fork hooks run latest-registered first, so this one runs before the template's.
FORKING = threading.Event()
os.register_at_fork(before=FORKING.set)
# Set, a child forked hangs where one forked on Python before 3.11.10 can (docs/versions.md): before multiprocessing's
# own after-fork functions run, end_with_parent among them, and deaf to SIGTERM.
HANG_IN_FORK = threading.Event()


def hang_if_asked() -> None:
    if HANG_IN_FORK.is_set():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Event().wait()


os.register_at_fork(after_in_child=hang_if_asked)


def beat(rank: int, batches: int, stack: list[str], quiet: float = 200.0, stage: str = "train") -> dict:
    return {
        "rank": rank, "local": rank, "pid": 4200 + rank, "node": 0, "host": "gpu-a", "address": "10.0.0.1",
        "batches": batches, "stage": stage, "quiet": quiet, "epoch": 0, "step": batches - 1, "stack": stack,
        "place": own_frame(stack), "run": "fit",
    }  # fmt: skip


def test_a_process_behind_the_others_that_made_no_progress_is_stalled_in_training():
    beats = {0: beat(0, 5, IN_ALL_REDUCE), 1: beat(1, 4, IN_DATASET), 2: beat(2, 5, IN_ALL_REDUCE)}
    assert stalled(beats, 120) == {1: "training"}
    assert beats[1]["place"] == "__getitem__ (/home/me/my_pkg/data.py:42)"


def test_where_a_process_waits_is_the_innermost_frame_of_the_users_code():
    assert own_frame(IN_DATASET + IN_WAIT) == "__getitem__ (/home/me/my_pkg/data.py:42)"  # not threading's wait
    assert own_frame(IN_LOADER) == f"select ({STDLIB}/selectors.py:415)"  # only libraries: the innermost
    assert own_frame([]) == "somewhere its stack does not show"


def test_a_process_stuck_in_its_own_step_while_the_others_wait_in_the_all_reduce_is_stalled():
    beats = {0: beat(0, 5, IN_ALL_REDUCE), 1: beat(1, 5, IN_FORWARD)}
    assert stalled(beats, 120) == {1: "training"}


def test_a_process_that_saves_is_busy_and_one_stuck_in_an_evaluation_is_stalled_there():
    assert stalled({0: beat(0, 5, IN_SAVE), 1: beat(1, 5, IN_ALL_REDUCE)}, 120) == {0: "saving a checkpoint"}
    for stage, what in [("validate", "validation"), ("sanity_check", "the sanity check"), ("predict", "prediction")]:
        behind = {0: beat(0, 9, IN_ALL_REDUCE, stage=stage), 1: beat(1, 8, IN_DATASET, stage=stage)}
        assert stalled(behind, 120) == {1: what}
    moved_on = {0: beat(0, 9, IN_FORWARD), 1: beat(1, 8, IN_DATASET, stage="validate")}  # rank 0 is training again
    assert stalled(moved_on, 120) == {1: "validation"}


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


def test_a_process_waiting_for_a_stuck_dataloader_worker_is_named_with_the_workers_pid_and_stack():
    predicting = beat(1, 4, IN_LOADER, stage="predict") | {"run": "predict", "read": 3}
    predicting |= {"worker": 4321, "worker_stack": IN_DATASET + IN_WAIT, "place": own_frame(IN_DATASET + IN_WAIT)}
    report = why_stopped.stall_report(predicting, "prediction", timedelta(minutes=5), timedelta(minutes=30))
    assert " has made no progress in prediction for 200 s (after 3 batches of predict), while " in report
    assert report.split("in a collective. ")[1].startswith(
        "Its main thread waits for its DataLoader worker (pid 4321), which is at:\n"
        '  File "/home/me/my_pkg/data.py", line 42, in __getitem__\n'
    )
    assert "selectors" not in report
    paragraph = why_stopped.stalled(predicting, "prediction", "stall_timeout (0:05:00)", "TAIL")
    assert (
        "longer than stall_timeout (0:05:00), while the other processes waited for it in a collective. Its "
        "DataLoader worker (pid 4321) was in __getitem__ (/home/me/my_pkg/data.py:42); every node's log" in paragraph
    )
    assert "set trainer.strategy.init_args.stall_timeout to 0. TAIL" in paragraph
    waited = why_stopped.stalled(beat(1, 4, IN_DATASET), "training", "the collective timeout (0:01:30)", "TAIL")
    assert "longer than the collective timeout (0:01:30), while the other processes" in waited
    assert "Its main thread was in __getitem__ (/home/me/my_pkg/data.py:42)" in waited
    assert "if such waits are expected, raise trainer.strategy.init_args.timeout. TAIL" in waited


def test_a_dataloader_worker_that_does_not_answer_is_named_by_its_pid_and_no_stack_is_made_up_for_it():
    silent = beat(1, 4, IN_LOADER) | {"worker": 4321, "worker_stack": [], "place": SILENT}
    report = why_stopped.stall_report(silent, "training", timedelta(minutes=5), timedelta(minutes=30))
    assert report.split("in a collective. ")[1] == (
        "Its main thread waits for its DataLoader worker (pid 4321), which is in a place it did not say (it did not "
        "answer within 0.5 s: stopped, or blocked in C code that holds Python's lock, such as a lock it inherited as "
        "it was forked: docs/versions.md names the Pythons that do that).\nThe job stops once it has made none for "
        "trainer.strategy.init_args.stall_timeout (0:05:00)."
    )
    paragraph = why_stopped.stalled(silent, "training", "stall_timeout (0:05:00)", "TAIL")
    assert f"collective. Its DataLoader worker (pid 4321) was in {SILENT}; every node's log" in paragraph
    assert "selectors" not in report + paragraph


def test_only_live_dataloader_workers_are_asked_where_they_are():
    def child(ends: bool) -> int:  # a process named as torch names its DataLoader workers
        pid = os.fork()
        if pid == 0:
            PRCTL(15, b"pt_data_worker")  # PR_SET_NAME
            if not ends:
                signal.pause()  # until the test kills it
            os._exit(0)
        return pid

    live, ended = child(ends=False), child(ends=True)
    try:
        wait_gone(ended, within=60)  # ended, not waited for yet (a zombie): it could never answer
        while "(pt_data_worker)" not in Path(f"/proc/{live}/stat").read_text():
            time.sleep(0.01)
        assert worker_stacks.data_workers() == [live]
    finally:
        os.kill(live, signal.SIGKILL)
        for pid in (live, ended):
            os.waitpid(pid, 0)


def loop(ready: int) -> SimpleNamespace:
    return SimpleNamespace(batch_progress=SimpleNamespace(total=SimpleNamespace(ready=ready)))


def test_a_process_tells_its_progress_and_once_it_stopped_making_any_where_its_main_thread_is():
    training, validating, predicting = loop(3), loop(0), loop(0)
    training.val_loop = validating
    trainer = SimpleNamespace(
        fit_loop=SimpleNamespace(epoch_loop=training), validate_loop=loop(0), test_loop=loop(0),
        predict_loop=predicting, state=SimpleNamespace(stage=RunningStage.TRAINING, fn=TrainerFn.FITTING),
        current_epoch=0, global_step=3,
    )  # fmt: skip
    activity = Activity(lambda: trainer, stack_after=0.2)
    first = activity()
    assert first["batches"] == 3 and first["stage"] == "train" and first["quiet"] < 0.2 and "stack" not in first
    time.sleep(0.3)
    found = []  # asked from another thread, as the heartbeat's
    asking = threading.Thread(target=lambda: found.append(activity()))
    asking.start()
    asking.join()
    late = found[0]
    assert "in test_a_process_tells_its_progress" in "".join(late["stack"])
    assert late["place"].startswith("test_a_process_tells_its_progress_and_once_it_stopped_making_any_where_its_main")
    trainer.state.stage = RunningStage.VALIDATING
    validating.batch_progress.total.ready = 1  # a validation batch is progress too
    assert "stack" not in activity() and activity()["batches"] == 4
    trainer.state = SimpleNamespace(stage=RunningStage.PREDICTING, fn=TrainerFn.PREDICTING)
    predicting.batch_progress.total.ready = 2
    assert activity()["run"] == "predict" and activity()["read"] == 2 and activity()["batches"] == 6
    assert Activity(lambda: None, 0.2)() == {}


def test_the_main_threads_stack_is_read_from_another_thread():
    found = []
    reader = threading.Thread(target=lambda: found.extend(main_thread_stack(12)))
    reader.start()
    reader.join()
    assert "test_the_main_threads_stack_is_read_from_another_thread" in "".join(found)


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
def test_a_fork_waits_until_a_read_of_the_main_threads_stack_ends(monkeypatch):
    """CPython before 3.11.10 reads the threads' frames holding its runtime's lock, which a DataLoader worker forked
    during the read inherits held, and hangs on (gh-112275), now and then. A read that waits until a fork has begun
    stands in for that: the fork must still come after the read."""
    reading, release, read = threading.Event(), threading.Event(), threading.Event()
    real = sys._current_frames

    def slow_read():
        reading.set()
        release.wait()
        frames = real()
        read.set()
        return frames

    monkeypatch.setattr(sys, "_current_frames", slow_read)
    reader = threading.Thread(target=main_thread_stack, args=(12,))
    reader.start()
    reading.wait()
    FORKING.clear()
    releaser = threading.Thread(target=lambda: FORKING.wait() and release.set())
    releaser.start()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    forked_after_the_read = read.is_set()  # without the wait, the reader cannot finish: this thread holds the GIL
    os.waitpid(pid, 0)
    reader.join()
    releaser.join()
    assert forked_after_the_read


@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded, use of fork")
def test_a_child_that_hung_in_its_fork_ends_with_its_process_when_that_ends_at_once(monkeypatch):
    HANG_IN_FORK.set()
    try:
        child = multiprocessing.get_context("fork").Process(target=os._exit, args=(0,), daemon=True)
        child.start()
    finally:
        HANG_IN_FORK.clear()
    exits: list[int] = []
    monkeypatch.setattr(os, "_exit", exits.append)  # this test's process goes on
    exit_at_once(1)  # how a stall's or a lost node's stop, or a second Ctrl-C, ends a process
    child.join(timeout=120)
    assert child.exitcode == -signal.SIGKILL
    assert exits == [1]
