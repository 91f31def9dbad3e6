"""A process of a one-node job (``python cli.py fit``, 2 CPU processes) that dies or is told to stop: the others stop
at once, and the node's output ends with one paragraph that names it and says that the same command goes on.

Each run is stopped at its own moment: rank 0 or rank 1 killed while its job starts, rank 0 or rank 1 killed in
training (held at a step), SIGTERM while rank 0 waits for a second node that the job's num_nodes asks for and nobody
started.
"""

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn

from tests.helpers import processes_in, wait_for_hold
from tests.helpers.one_node import gone, job_processes, last_paragraph, local_ranks, start, traces, wait_gone
from training.job.startup import Stopped
from training.job.stop_signal import StopRequests

pytestmark = pytest.mark.distributed

PEER_TIMEOUT = 60  # seconds, the config's
HOLD_STEP = 3


def rank_one(workdir: Path, rank_zero: subprocess.Popen) -> int:
    """The pid of the process rank 0 started, once it runs."""
    return local_ranks(workdir, rank_zero, 2)[1]


@pytest.fixture(scope="module")
def killed_while_starting(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("starting")
    zero = start(workdir)
    one = rank_one(workdir, zero)
    zero.kill()  # while rank 1 is still importing: it never reached the store rank 0 held
    zero.wait()
    seconds = wait_gone(one, 240)
    return {"zero": zero.pid, "seconds": seconds, "output": (workdir / "output").read_text()}


def test_rank_0_killed_while_the_job_starts_stops_rank_1_at_once_saying_why(killed_while_starting):
    assert killed_while_starting["seconds"] < 240, "rank 1 waited for the join timeout"
    paragraph = last_paragraph(killed_while_starting["output"])
    assert paragraph.startswith(
        f"error: the job cannot start: rank 0 (local rank 0, pid {killed_while_starting['zero']}) of node 0 ("
    )
    assert "which started this process, ended" in paragraph
    assert paragraph.endswith("Nothing was trained: run the same command again (on every node) to start the job.")


@pytest.fixture(scope="module")
def rank_1_killed_while_starting(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("starting1")
    zero = start(workdir)
    one = rank_one(workdir, zero)
    os.kill(one, signal.SIGKILL)  # while it imports: rank 0 waits for it to join
    zero.wait(timeout=240)
    return {"one": one, "status": zero.returncode, "output": (workdir / "output").read_text()}


def test_rank_1_killed_while_the_job_starts_is_named_by_rank_0_at_once(rank_1_killed_while_starting):
    assert rank_1_killed_while_starting["status"] == 1
    paragraph = last_paragraph(rank_1_killed_while_starting["output"])
    assert paragraph.startswith(
        f"error: the job cannot start: rank 1 (local rank 1, pid {rank_1_killed_while_starting['one']}) of node 0 ("
    )
    assert ") was killed by SIGKILL (by someone, or by the system when memory ran out" in paragraph


def killed_in_training(workdir: Path, victim: int) -> dict:
    hold = workdir / "hold"
    args = ["--trainer.max_epochs=1", "--data.init_args.num_train=1024", "--trainer.logger=false"]
    args += ["--trainer.callbacks+=tests.helpers.probe.HoldAtStep", f"--trainer.callbacks.step={HOLD_STEP}"]
    zero = start(workdir, *args, f"--trainer.callbacks.hold_file={hold}")
    hold.touch()
    one = rank_one(workdir, zero)
    wait_for_hold(hold, 2, zero)
    pids = [zero.pid, one]
    os.kill(pids[victim], signal.SIGKILL)
    hold.unlink()
    seconds = wait_gone(pids[1 - victim], PEER_TIMEOUT)
    zero.wait()
    return {"pids": pids, "seconds": seconds, "status": zero.returncode, "output": (workdir / "output").read_text()}


@pytest.fixture(scope="module")
def rank_1_killed(tmp_path_factory):
    return killed_in_training(tmp_path_factory.mktemp("rank1"), victim=1)


@pytest.fixture(scope="module")
def rank_0_killed(tmp_path_factory):
    return killed_in_training(tmp_path_factory.mktemp("rank0"), victim=0)


def test_rank_1_killed_in_training_is_named_by_rank_0_with_the_command_that_resumes(rank_1_killed):
    assert rank_1_killed["status"] == 1, "not rank 0's own exit"
    assert "Forcefully terminating" not in rank_1_killed["output"]
    paragraph = last_paragraph(rank_1_killed["output"])
    assert paragraph.startswith(
        f"error: the job stopped: rank 1 (local rank 1, pid {rank_1_killed['pids'][1]}) of node 0 ("
    )
    assert ") was killed by SIGKILL (by someone, or by the system when memory ran out" in paragraph
    assert f"This node had reached epoch 0, step {HOLD_STEP}." in paragraph
    assert "To resume from it, run the same command again; this node was started with: python " in paragraph
    assert rank_1_killed["output"].count("error: ") == 1


def test_rank_0_killed_in_training_is_named_by_rank_1_with_the_command_that_resumes(rank_0_killed):
    assert "sendBytes failed" not in rank_0_killed["output"]
    paragraph = last_paragraph(rank_0_killed["output"])
    assert paragraph.startswith(
        f"error: the job stopped: rank 0 (local rank 0, pid {rank_0_killed['pids'][0]}) of node 0 ("
    )
    assert "which started this process, ended" in paragraph
    assert f"This node had reached epoch 0, step {HOLD_STEP}." in paragraph
    assert "To resume from it, run the same command again; this node was started with: python " in paragraph
    assert rank_0_killed["output"].count("error: ") == 1


@pytest.fixture(scope="module")
def terminated_while_waiting(tmp_path_factory):
    """SIGTERM to rank 0 once it says it waits for node 1, which the job's num_nodes=2 asks for."""
    workdir = tmp_path_factory.mktemp("terminated")
    zero = start(workdir, "--trainer.num_nodes=2")
    one = rank_one(workdir, zero)
    output = workdir / "output"
    while "node rank 1 not yet" not in output.read_text():
        assert zero.poll() is None, output.read_text()
        time.sleep(0.05)
    zero.send_signal(signal.SIGTERM)
    zero.wait(timeout=120)
    wait_gone(one, 60)
    return {"status": zero.returncode, "output": output.read_text()}


def test_the_join_progress_line_says_which_num_nodes_the_job_waits_for(terminated_while_waiting):
    assert (
        "node rank 1 not yet (the job has num_nodes=2: for fewer nodes, set trainer.num_nodes or NUM_NODES)"
        in terminated_while_waiting["output"]
    )


def test_sigterm_while_the_job_starts_stops_it_with_a_paragraph(terminated_while_waiting):
    assert terminated_while_waiting["status"] == 1
    paragraph = last_paragraph(terminated_while_waiting["output"])
    assert paragraph.startswith("error: node 0 (")
    assert paragraph.endswith(
        ") was stopped by a signal (SIGTERM) before training started: nothing was trained and no checkpoint was "
        "written. Run the same command again (on every node) to start the job."
    )


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signal.SIGTERM - 1)))


def test_sigterm_while_cli_imports_torch_and_lightning_stops_it_with_a_paragraph(tmp_path):
    """cli.py takes SIGTERM from its first lines, before the seconds of its imports: sent as soon as it does."""
    zero = start(tmp_path)
    while not catches_sigterm(zero.pid):
        assert zero.poll() is None, (tmp_path / "output").read_text()
        time.sleep(0.01)
    zero.send_signal(signal.SIGTERM)
    assert zero.wait(timeout=120) == 1
    output = (tmp_path / "output").read_text()
    assert "Traceback" not in output, output
    assert last_paragraph(output) == (
        f"error: cli.py on {socket.gethostname()} was stopped by a signal (SIGTERM) while it started, before "
        "training: nothing was trained and no checkpoint was written. Run the same command again to start the job."
    )
    assert not (tmp_path / "logs").exists()


def terminated_while_held(workdir: Path, processes: int, *args: str, subcommand: str = "fit") -> dict:
    """SIGTERM to the launching process once every process of the job holds at workdir/hold (``args`` say where);
    then what the job left."""
    hold = workdir / "hold"
    hold.touch()
    zero = start(workdir, f"--trainer.devices={processes}", *args, subcommand=subcommand)
    try:
        wait_for_hold(hold, processes, zero)
        job = processes_in(workdir)
        zero.send_signal(signal.SIGTERM)
        zero.wait(timeout=120)
        left = still_running(job, within=60)
    finally:  # what a failed run left holding
        hold.unlink(missing_ok=True)
        for pid in processes_in(workdir):
            os.kill(pid, signal.SIGKILL)
    checkpoints = sorted(str(path.relative_to(workdir)) for path in workdir.rglob("*.ckpt"))
    records = sorted(str(path.relative_to(workdir)) for path in workdir.rglob("*config*.yaml"))
    output = (workdir / "output").read_text()
    return {"status": zero.returncode, "output": output, "left": left, "checkpoints": checkpoints, "records": records}


def held_while_starting(workdir: Path, at: str) -> list[str]:
    """The options of tests.helpers.probe.HoldWhileStarting, holding at ``at``."""
    strategy = "--trainer.strategy.class_path=tests.helpers.probe.HoldWhileStarting"
    return [
        strategy,
        f"--trainer.strategy.init_args.hold_file={workdir / 'hold'}",
        f"--trainer.strategy.init_args.at={at}",
    ]


def still_running(pids: list[int], within: float) -> list[int]:
    """Those of ``pids`` still running once all have ended or ``within`` seconds have passed."""
    deadline = time.monotonic() + within
    while (running := [pid for pid in pids if not gone(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return running


@pytest.fixture(scope="module")
def terminated_once_launched(tmp_path_factory):
    """Lightning has started the node's other process: neither has begun the start-up handshake."""
    workdir = tmp_path_factory.mktemp("launched")
    return terminated_while_held(workdir, 2, *held_while_starting(workdir, "launched"))


@pytest.fixture(scope="module")
def terminated_once_set_up(tmp_path_factory):
    """The strategy is set up (the processes joined, the model is wrapped); Lightning's handler is not there yet."""
    workdir = tmp_path_factory.mktemp("set_up")
    return terminated_while_held(workdir, 2, *held_while_starting(workdir, "set_up"))


@pytest.fixture(scope="module")
def terminated_predict_of_one_process(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("predict")
    held = held_while_starting(workdir, "set_up")
    return terminated_while_held(workdir, 1, *held, "--ckpt_path=untrained", subcommand="predict")


def assert_stopped_before_training(stopped: dict) -> None:
    """Exit status 1, every process of the job gone, one paragraph at the end, no traceback, no checkpoint."""
    assert stopped["status"] == 1, stopped["output"]
    assert stopped["left"] == [], "processes of the job left running"
    assert last_paragraph(stopped["output"]) == (
        f"error: node 0 ({socket.gethostname()}) was stopped by a signal (SIGTERM) before training started: nothing "
        "was trained and no checkpoint was written. Run the same command again (on every node) to start the job."
    )
    assert stopped["output"].count("error: ") == 1, stopped["output"]
    assert stopped["checkpoints"] == []


def test_sigterm_once_lightning_started_the_nodes_processes_stops_them_all_with_one_paragraph(terminated_once_launched):
    assert_stopped_before_training(terminated_once_launched)


def test_sigterm_after_the_strategys_setup_stops_every_process_with_one_paragraph(terminated_once_set_up):
    assert_stopped_before_training(terminated_once_set_up)


def test_sigterm_before_lightnings_handler_in_a_one_process_predict_stops_it_speaking_of_the_predictions(
    terminated_predict_of_one_process,
):
    stopped = terminated_predict_of_one_process
    assert stopped["status"] == 1, stopped["output"]
    assert stopped["left"] == [], "processes of the job left running"
    assert last_paragraph(stopped["output"]) == (
        f"error: node 0 ({socket.gethostname()}) was stopped by a signal (SIGTERM) before predict ended: it wrote no "
        "predictions, and the run's checkpoints are as they were. Run the same command again (on every node) to "
        "predict."
    )
    assert stopped["output"].count("error: ") == 1, stopped["output"]
    assert stopped["checkpoints"] == []
    assert stopped["records"] == [], "the config of predictions that were never written"


def test_ctrl_c_in_the_last_validation_is_acknowledged_and_a_second_as_the_run_ends_stops_it_at_once(tmp_path):
    """Ctrl-C to every process during the validation after the last training batch, where the ranks agree on no
    further stop, then again while they tear down."""
    validating, ending = tmp_path / "validating", tmp_path / "ending"
    validating.touch()
    ending.touch()
    holds = [
        "--trainer.callbacks+=tests.helpers.probe.HoldInSanityCheck",
        f"--trainer.callbacks.hold_file={validating}",
        "--trainer.callbacks.epoch=0",
        "--trainer.callbacks+=tests.helpers.probe.HoldAtTeardown",
        f"--trainer.callbacks.hold_file={ending}",
    ]
    limits = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2"]
    job = start(tmp_path, *limits, "--trainer.logger=false", *holds)
    try:
        wait_for_hold(validating, 2, job)
        os.killpg(job.pid, signal.SIGINT)
        validating.unlink()
        wait_for_hold(ending, 2, job)
        os.killpg(job.pid, signal.SIGINT)
        job.wait(timeout=120)
    finally:
        ending.unlink(missing_ok=True)
    output = (tmp_path / "output").read_text()
    assert job.returncode == 130, output
    acknowledged = (
        "Ctrl-C (SIGINT) arrived during the last validation: training had finished, and the run ends as it would "
        "have. A second Ctrl-C stops it at once."
    )
    assert output.count(acknowledged) == 1, output
    assert last_paragraph(output) == (
        "error: stopped at once by a second Ctrl-C: nothing more was saved. Run the same command again to resume from "
        "the run's last checkpoint."
    )
    assert not traces(output), output
    assert still_running(processes_in(tmp_path), within=60) == []
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt")["global_step"] == 2


def test_a_ctrl_c_once_training_has_ended_gets_one_line_and_no_keyboard_interrupt(monkeypatch, capfd):
    requests = StopRequests()
    requests.disarm()
    monkeypatch.setattr(os, "_exit", lambda status: pytest.fail(f"exited with {status}"))
    requests.handle(signal.SIGINT, None)  # raises nothing: an atexit callback or teardown goes on
    assert capfd.readouterr().err.strip() == (
        "Ctrl-C (SIGINT) arrived as training ended: training had finished, and the run ends as it would have. A "
        "second Ctrl-C stops it at once."
    )


def test_a_second_signal_while_a_rank_stops_before_training_changes_nothing():
    # Ctrl-C to the job's process group reaches local rank 1 twice: from the terminal, and from rank 0, which passes it
    # on; Lightning's teardown gives the handler back in between. Seen in a sweep of Ctrl-C times under load as a
    # KeyboardInterrupt traceback in the middle of rank 1's stop.
    requests = StopRequests()
    launcher = SimpleNamespace(kill=lambda signum: None)
    requests.trainer = SimpleNamespace(
        strategy=SimpleNamespace(launcher=launcher), node_rank=0, state=SimpleNamespace(fn=TrainerFn.FITTING)
    )
    requests.trainer.interrupted = False
    with pytest.raises(Stopped):
        requests.handle(signal.SIGINT, None)
    requests.trainer.interrupted = True  # Lightning's teardown of the stopped run
    requests.handle(signal.SIGINT, None)  # raises nothing


def test_sigterm_once_the_run_has_ended_ends_the_process_as_without_the_template(tmp_path):
    """After a run that ended well, Lightning has put back the default it found: SIGTERM ends the process (-15)
    without a word about a start, as it would without the template."""
    hold = [
        "--trainer.callbacks+=tests.helpers.probe.HoldAtTeardown",
        f"--trainer.callbacks.hold_file={tmp_path / 'hold'}",
    ]
    limits = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2"]
    ended = terminated_while_held(tmp_path, 1, *limits, "--trainer.logger=false", *hold)
    assert ended["status"] == -signal.SIGTERM, ended["output"]
    assert "error: " not in ended["output"] and "Traceback" not in ended["output"], ended["output"]


def test_a_bug_in_rank_0s_data_worker_ends_the_node_before_the_command_returns_with_the_jobs_state_last(tmp_path):
    # A corrupt sample: the 5th read of a DataLoader worker of rank 0 raises. The user's traceback is printed, and the
    # command returns only once rank 1 and every DataLoader worker are gone, with the paragraph after the traceback.
    corrupt = ["--data=tests.zoo.FileSamples", "--data.init_args.stall_rank=0", "--data.init_args.corrupt_at=5"]
    job = start(tmp_path, *corrupt, "--trainer.max_epochs=1")
    assert job.wait(timeout=300) == 1
    output = (tmp_path / "output").read_text()
    assert job_processes(tmp_path) == [], output  # rank 1 gone with its command; its workers, killed, a moment later
    assert "ValueError: sample " in output and "is corrupt: cannot decode it" in output  # the user's traceback
    lines = output.rstrip().splitlines()
    assert lines[-1].startswith(f"error: the job stopped: rank 0 (local rank 0, pid {job.pid}) of node 0 ("), output
    assert "stopped with the error above (ValueError: Caught ValueError in DataLoader worker process " in lines[-1]
    assert "); the rest of the job stopped with it. This node had reached epoch 0, step " in lines[-1]
    assert "To resume from it, run the same command again; this node was started with: python " in lines[-1]
    assert output.count("error: ") == 1, output
    assert "Traceback" in output.split(lines[-1])[0], "the traceback comes before the paragraph"
