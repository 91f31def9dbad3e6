"""One training at a time per run: a second copy of a run stops before it trains, and a dead holder blocks nothing."""

import os
import signal
import socket
import time

import pytest

from tests.helpers import DDP_YAML, REPO, SINGLE_PROCESS, free_port, run_script
from training.run.lock import LockFile, holders, refusal

ONE_EPOCH = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=1"]


def test_a_lock_is_refused_while_held_naming_its_holder_and_its_file_goes_with_it(tmp_path):
    path = tmp_path / "fit.lock"
    mine = LockFile(path)
    assert mine.acquire() is None
    holder = LockFile(path).acquire()  # flock: another open of the file is another holder, even in this process
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname() and holder["since"]
    mine.release()
    assert not path.exists()
    again = LockFile(path)
    assert again.acquire() is None
    again.release()


def test_a_holder_that_died_blocks_nobody(tmp_path):
    path = tmp_path / "fit.lock"
    child = os.fork()
    if child == 0:  # a holder that takes the lock and is killed
        try:
            LockFile(path).acquire()
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
    assert f'"pid": {child}' in path.read_text(), "the holder should have died holding its lock"
    lock = LockFile(path)
    assert lock.acquire() is None
    assert f'"pid": {os.getpid()}' in path.read_text()
    lock.release()


def test_a_lock_held_by_a_process_its_ended_holder_forked_names_that_process(tmp_path, monkeypatch):
    monkeypatch.setattr("training.run.lock.ORPHAN_GRACE", 0.0)
    path = tmp_path / "fit.lock"
    released = tmp_path / "released"
    holder = os.fork()
    if holder == 0:  # takes the lock, forks a child that inherits it (a DataLoader worker that hangs), and ends
        try:
            LockFile(path).acquire()
            if os.fork() == 0:
                while not released.exists():
                    time.sleep(0.02)
        finally:
            os._exit(0)
    os.waitpid(holder, 0)
    forked = holders(path)
    try:
        found = LockFile(path).acquire()
        assert found["pid"] == holder and found["holders"] == forked and len(forked) == 1
        assert forked[0] != holder
        paragraph = refusal(tmp_path, found)
        host = socket.gethostname()
        assert f"is already training: pid {forked[0]} on {host} (forked by pid {holder}, which has ended) holds " in (
            paragraph
        )
        assert f"stop it (kill {forked[0]} on {host})" in paragraph
    finally:
        released.touch()


def test_a_second_copy_of_a_run_stops_before_it_trains_and_changes_nothing(run_cli, capsys, tmp_path):
    fit = ["fit", "-c", DDP_YAML, *SINGLE_PROCESS, *ONE_EPOCH]
    run_cli(*fit, "--trainer.max_epochs=1")
    run = tmp_path / "logs" / "toy" / "default"
    assert not (run / "fit.lock").exists(), "a finished run still holds its lock"
    other = LockFile(run / "fit.lock")  # as the first copy would, training
    assert other.acquire() is None
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_:
        run_cli(*fit, "--trainer.max_epochs=2")
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    since = before[run / "fit.lock"].decode().split('"since": "')[1].split('"')[0]
    assert err.strip().splitlines()[-1] == (
        f"error: the run in {run} is already training: another process (pid {os.getpid()} on "
        f"{socket.gethostname()}, since {since}) holds its fit.lock. Two copies of one run would write the same "
        f"checkpoints and curves. Wait for it to end, stop it (kill {os.getpid()} on {socket.gethostname()}), or "
        "start this one as another run with RUN_ID=<new id>. This attempt changed nothing."
    )
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before
    other.release()
    result = run_cli(*fit, "--trainer.max_epochs=2")
    assert result.trainer.current_epoch == 2


@pytest.mark.distributed
def test_every_process_of_a_second_copy_stops_with_one_paragraph(tmp_path):
    run = tmp_path / "logs" / "toy" / "default"
    run.mkdir(parents=True)
    lock = LockFile(run / "fit.lock")
    assert lock.acquire() is None
    try:
        args = [str(REPO / "cli.py"), "fit", "-c", DDP_YAML, *ONE_EPOCH]
        result = run_script(args, cwd=tmp_path, env={"MASTER_PORT": str(free_port())}, timeout=600)
    finally:
        lock.release()
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stderr.count("error: the run in") == 1 and "is already training" in result.stderr
    assert "Traceback" not in result.stderr
    assert sorted(path.name for path in run.iterdir()) == [], "the refused job left files in the run's directory"
