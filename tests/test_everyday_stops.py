"""The everyday stops of a one-node job (``python cli.py fit``, 2 CPU processes) as a terminal delivers them: to the
whole process group, as Ctrl-C does, or by closing the terminal itself.

One run, its samples read by DataLoader workers, is stopped three times and resumed by the same command each time:
Ctrl-C in epoch 0, SIGTERM to every process of the run (as GNU ``timeout``, Slurm and systemd send it) in epoch 1,
then its terminal closed in epoch 2 (SIGHUP), then trained to its end. Another run gets Ctrl-C twice. Each phase of a
start (cli.py's imports, the node's processes started, the strategy set up, the sanity check) gets Ctrl-C or SIGHUP
once.
"""

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import (
    DDP_YAML,
    REPO,
    assert_everything_stopped,
    copy_project,
    finish,
    free_port,
    launch,
    launcher_env,
    processes_in,
    wait_for_hold,
)
from tests.helpers.one_node import (
    HANGUP_STEP,
    INTERRUPT_STEP,
    READ_BY_WORKERS,
    RUN,
    STEPS_PER_EPOCH,
    TERMINATE_STEP,
    ended,
    gone,
    held_at,
    job_processes,
    last_paragraph,
    local_ranks,
    saved,
    saved_in,
    signalled_at,
    start,
    stop_line,
    wait_gone,
)
from tests.helpers.terminal import Terminal
from training.config.checks import SKIPPED_STEP
from training.job.node_processes import is_frozen
from training.run.lock import holders

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("everyday")


@pytest.fixture(scope="module")
def interrupted(workdir):
    """Ctrl-C while the ranks hold at INTERRUPT_STEP."""
    result = signalled_at(workdir, workdir / "interrupt.hold", INTERRUPT_STEP, signal.SIGINT, *READ_BY_WORKERS)
    return result | {"checkpoint": saved(result)}


@pytest.fixture(scope="module")
def terminated(workdir, interrupted):
    """The same command, its process group sent SIGTERM while the ranks hold at TERMINATE_STEP."""
    hold = workdir / "terminate.hold"
    result = signalled_at(workdir, hold, TERMINATE_STEP, signal.SIGTERM, *READ_BY_WORKERS)
    return result | {"checkpoint": saved(result)}


@pytest.fixture(scope="module")
def hung_up(workdir, terminated):
    """The same command in a terminal, which closes while the ranks hold at HANGUP_STEP."""
    hold = workdir / "hangup.hold"
    hold.touch()
    terminal = Terminal(workdir / "output")
    job = start(workdir, *READ_BY_WORKERS, *held_at(hold, HANGUP_STEP), terminal=terminal.take_control)
    os.close(terminal.slave)
    wait_for_hold(hold, 2, job)
    terminal.close()
    os.killpg(job.pid, signal.SIGHUP)
    result = ended(workdir, job)
    hold.unlink(missing_ok=True)
    node_log = workdir / "logs" / "nodes" / "node0.log"
    return result | {"checkpoint": saved(result), "log": node_log.read_text() if node_log.exists() else ""}


@pytest.fixture(scope="module")
def finished(workdir, hung_up):
    job = start(workdir, *READ_BY_WORKERS)
    return ended(workdir, job, within=600)


def test_ctrl_c_in_training_saves_last_ckpt_says_so_once_and_stops_every_process(interrupted):
    assert interrupted["status"] == 130, interrupted["output"]
    stop = stop_line(interrupted["output"])
    assert stop[1] == "Ctrl-C (SIGINT)"
    step = int(stop[3])
    assert INTERRUPT_STEP <= step < STEPS_PER_EPOCH
    assert interrupted["checkpoint"]["global_step"] == step
    assert interrupted["output"].count("Stopped by") == 1
    assert "KeyboardInterrupt" not in interrupted["output"]
    assert interrupted["left"] == [], "processes of the job left running"
    # A best checkpoint is never newer than last.ckpt.
    assert interrupted["checkpoints"] == ["last.ckpt"]


def test_sigterm_to_every_process_with_dataloader_workers_saves_and_stops_as_sigterm_to_one(interrupted, terminated):
    assert terminated["status"] == 0, terminated["output"]
    resumed_at = interrupted["checkpoint"]["global_step"]
    assert f"(epoch 0, step {resumed_at})." in terminated["output"]
    stop = stop_line(terminated["output"])  # no traceback of a worker killed by the signal
    assert stop[1] == "a signal (SIGTERM)"
    assert stop[2] == "1" and TERMINATE_STEP <= int(stop[3]) < 2 * STEPS_PER_EPOCH
    assert terminated["checkpoint"]["global_step"] == int(stop[3])
    assert terminated["output"].count("Stopped by") == 1
    assert terminated["left"] == [], "processes of the job left running"


def test_a_closed_terminal_saves_last_ckpt_and_writes_the_paragraph_to_the_node_log(terminated, hung_up):
    assert hung_up["status"] == 129, hung_up["output"] + hung_up["log"]
    resumed_at = terminated["checkpoint"]["global_step"]
    assert f"(epoch 1, step {resumed_at})." in hung_up["output"]
    stop = stop_line(hung_up["log"])
    assert stop[1] == "its terminal closing (SIGHUP)"
    assert stop[2] == "2" and HANGUP_STEP <= int(stop[3]) < 3 * STEPS_PER_EPOCH
    assert hung_up["checkpoint"]["global_step"] == int(stop[3])
    assert hung_up["left"] == [], "processes of the job left running"


def test_the_same_command_resumes_after_each_stop_and_trains_to_the_end(hung_up, finished):
    assert finished["status"] == 0, finished["output"]
    step = hung_up["checkpoint"]["global_step"]
    assert f"Resuming from {finished['run']}/checkpoints/last.ckpt (epoch 2, step {step})." in finished["output"]
    assert saved(finished)["global_step"] == 3 * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def interrupted_twice(tmp_path_factory):
    """Ctrl-C, then Ctrl-C again while the ranks still hold (the first noted by both)."""
    workdir = tmp_path_factory.mktemp("twice")
    hold = workdir / "hold"
    hold.touch()
    job = start(workdir, *RUN, *held_at(hold, INTERRUPT_STEP, release_on_signal=False))
    wait_for_hold(hold, 2, job)
    os.killpg(job.pid, signal.SIGINT)
    for rank in range(2):
        while not Path(f"{hold}.signalled.rank{rank}").exists():
            assert job.poll() is None, (workdir / "output").read_text()
            time.sleep(0.02)
    os.killpg(job.pid, signal.SIGINT)
    return ended(workdir, job)


def test_a_second_ctrl_c_stops_at_once_with_one_line(interrupted_twice):
    assert interrupted_twice["status"] == 130, interrupted_twice["output"]
    assert last_paragraph(interrupted_twice["output"]) == (
        "error: stopped at once by a second Ctrl-C: nothing more was saved. Run the same command again to resume "
        "from the run's last checkpoint."
    )
    assert interrupted_twice["left"] == [], "processes of the job left running"


def catches(pid: int, signum: int) -> bool:
    """Whether the process has a handler for ``signum`` (its SigCgt mask in /proc)."""
    status = Path(f"/proc/{pid}/status").read_text()
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught & (1 << (signum - 1)))


STARTING = {
    # where the job is held: its options, the signal, and which words the paragraph starts with
    "launched": (
        lambda hold: [
            "--trainer.strategy.class_path=tests.helpers.probe.HoldWhileStarting",
            f"--trainer.strategy.init_args.hold_file={hold}",
            "--trainer.strategy.init_args.at=launched",
        ],
        signal.SIGINT,
    ),
    "set_up": (
        lambda hold: [
            "--trainer.strategy.class_path=tests.helpers.probe.HoldWhileStarting",
            f"--trainer.strategy.init_args.hold_file={hold}",
            "--trainer.strategy.init_args.at=set_up",
        ],
        signal.SIGHUP,
    ),
    "sanity_check": (
        lambda hold: [
            "--trainer.callbacks+=tests.helpers.probe.HoldInSanityCheck",
            f"--trainer.callbacks.hold_file={hold}",
        ],
        signal.SIGINT,
    ),
}


@pytest.mark.parametrize("phase", STARTING)
def test_ctrl_c_or_sighup_while_the_job_starts_stops_every_process_with_one_paragraph(tmp_path, phase):
    options, signum = STARTING[phase]
    hold = tmp_path / "hold"
    hold.touch()
    job = start(tmp_path, *RUN, *options(hold))
    wait_for_hold(hold, 2, job)
    os.killpg(job.pid, signum)
    result = ended(tmp_path, job)
    hold.unlink()
    assert result["status"] == 1, result["output"]
    name = signal.Signals(signum).name
    cause = "Ctrl-C (SIGINT)" if signum == signal.SIGINT else "its terminal closing (SIGHUP)"
    assert last_paragraph(result["output"]) == (
        f"error: node 0 ({socket.gethostname()}) was stopped by {cause} before training started: nothing was trained "
        "and no checkpoint was written. Run the same command again (on every node) to start the job."
    ), name
    assert result["output"].count("error: ") == 1, result["output"]
    assert result["left"] == [], "processes of the job left running"
    assert result["checkpoints"] == []


def test_ctrl_c_while_cli_imports_torch_and_lightning_stops_it_with_a_paragraph(tmp_path):
    job = start(tmp_path)
    while not catches(job.pid, signal.SIGHUP):  # cli.py's first lines take SIGHUP with SIGINT; Python has SIGINT
        assert job.poll() is None, (tmp_path / "output").read_text()
        time.sleep(0.01)
    os.killpg(job.pid, signal.SIGINT)
    result = ended(tmp_path, job)
    assert result["status"] == 1
    assert last_paragraph(result["output"]) == (
        f"error: cli.py on {socket.gethostname()} was stopped by a signal (SIGINT) while it started, before "
        "training: nothing was trained and no checkpoint was written. Run the same command again to start the job."
    )
    assert result["left"] == []


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    return copy_project(tmp_path_factory.mktemp("launcher"))


@pytest.fixture(scope="module")
def port():
    return str(free_port())


@pytest.fixture(scope="module")
def launcher_hung_up(node, port):
    """The launcher in a terminal that closes while the ranks hold at INTERRUPT_STEP."""
    hold = node / "hangup.hold"
    hold.touch()
    terminal = Terminal(node / "terminal.out")
    command = [str(node / "scripts" / "run_ddp_train.sh"), "cpu:2", "0", *RUN, *held_at(hold, INTERRUPT_STEP)]
    env = launcher_env(MASTER_PORT=port)
    launcher = subprocess.Popen(command, env=env, start_new_session=True, preexec_fn=terminal.take_control)
    os.close(terminal.slave)
    wait_for_hold(hold, 2, launcher)
    terminal.close()
    os.killpg(launcher.pid, signal.SIGHUP)
    launcher.wait(timeout=120)
    hold.unlink(missing_ok=True)
    result = {"status": launcher.returncode, "log": (node / "logs" / "nodes" / "node0.log").read_text()}
    return result | {"run": node / "logs" / "toy" / "default", "checkpoint": saved_in(node)}


def test_a_closed_terminal_on_the_launcher_saves_and_ends_the_node_log_with_the_paragraph(node, port, launcher_hung_up):
    log = launcher_hung_up["log"]
    assert launcher_hung_up["status"] == 129, log
    assert "node 0: the terminal closed, stopping training: sending SIGHUP to" in log
    stops = [line for line in log.splitlines() if line.startswith("Stopped by")]
    assert len(stops) == 1, log
    stop = stop_line(stops[0])
    assert stop[1] == "its terminal closing (SIGHUP)", log
    assert stop[2] == "0" and launcher_hung_up["checkpoint"]["global_step"] == int(stop[3]) >= INTERRUPT_STEP
    assert log.rstrip().endswith("node 0: training exited with status 129; its output is in logs/nodes/node0.log")
    assert_everything_stopped(node, port)


@pytest.fixture(scope="module")
def detached(node, port, launcher_hung_up):
    """The same command with DETACH=1, stopped as the line it prints says once the ranks hold at TERMINATE_STEP."""
    hold = node / "detached.hold"
    hold.touch()
    output = finish(launch(node, "cpu:2", 0, *RUN, *held_at(hold, TERMINATE_STEP), DETACH="1", MASTER_PORT=port))
    pid = int(re.search(r"as pid (\d+)", output)[1])
    for rank in range(2):
        while not Path(f"{hold}.rank{rank}").exists():
            assert not gone(pid), (node / "logs" / "nodes" / "node0.log").read_text()
            time.sleep(0.05)
    # Read once training runs: until then the pid may still be the subshell that becomes the launcher.
    session, terminal = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[3:5]
    stop = re.search(r"Stop it, with last.ckpt saved: (kill -INT \d+)", output)[1]
    subprocess.run(stop.split(), check=True)
    while not gone(pid):
        time.sleep(0.05)
    hold.unlink(missing_ok=True)
    log = (node / "logs" / "nodes" / "node0.log").read_text()
    return {
        "checkpoint": saved_in(node),
        "output": output,
        "pid": pid,
        "session": int(session),
        "terminal": int(terminal),
        "log": log,
        "run": launcher_hung_up["run"],
    }


def test_a_detached_node_runs_in_a_session_of_its_own_without_a_terminal(node, detached):
    assert (
        detached["output"]
        .rstrip()
        .endswith(
            f"Follow it: tail -f {node}/logs/nodes/node0.log. Stop it, with "
            f"last.ckpt saved: kill -INT {detached['pid']}"
        )
    )
    assert detached["session"] == detached["pid"] and detached["terminal"] == 0


def test_a_detached_node_resumes_and_its_stop_saves_last_ckpt(node, port, launcher_hung_up, detached):
    log = detached["log"]
    previous = launcher_hung_up["checkpoint"]["global_step"]
    assert f"Resuming from {detached['run']}/checkpoints/last.ckpt (epoch 0, step {previous})." in log
    stop = stop_line([line for line in log.splitlines() if line.startswith("Stopped by")][-1])
    assert stop[1] == "Ctrl-C (SIGINT)"
    assert stop[2] == "1" and detached["checkpoint"]["global_step"] == int(stop[3]) >= TERMINATE_STEP
    # The launcher passed the Ctrl-C on once, to the process it started, which saved and stopped its node's others.
    assert "node 0: interrupted, stopping training: sending SIGINT to" in log
    assert "KeyboardInterrupt" not in log
    assert "still running after" not in log, "training ignored the signal and was killed"
    assert_everything_stopped(node, port)


def test_a_rank_killed_while_its_dataloader_worker_hangs_leaves_neither_the_worker_nor_the_run_lock(tmp_path):
    stall = tmp_path / "stall"
    stall.touch()
    data = ["--data=tests.zoo.FileSamples", f"--data.init_args.stall_file={stall}", "--trainer.max_epochs=1"]
    job = start(tmp_path, *data, devices=1)
    reported = Path(f"{stall}.rank0")
    while not reported.exists() or not reported.read_text():
        assert job.poll() is None, (tmp_path / "output").read_text()
        time.sleep(0.05)
    worker = int(reported.read_text())
    job.kill()  # the out-of-memory killer, or kill -9, while the rank waits for the worker's batch
    job.wait()
    lock = tmp_path / "logs" / "toy" / "default" / "fit.lock"
    try:
        wait_gone(worker, 60)
        deadline = time.monotonic() + 60  # the rank's other worker, killed at the same time, may end a moment later
        while holders(lock) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert holders(lock) == []
    finally:
        stall.unlink()  # lets a worker left running end
    again = ended(tmp_path, start(tmp_path, *data, devices=1), within=600)
    assert again["status"] == 0, again["output"]
    assert "is already training" not in again["output"]


PEER_TIMEOUT = 5  # seconds: a shorter peer_timeout than the config's, so that the suspension below outlasts it
SHORT_RUN = ["--trainer.max_epochs=1", "--data.init_args.num_train=1024", "--trainer.logger=false"]  # 8 steps
QUICK_LIVENESS = f"--trainer.strategy.init_args.peer_timeout=0:00:{PEER_TIMEOUT:02d}"


def test_a_job_suspended_as_a_whole_for_longer_than_peer_timeout_goes_on_once_resumed(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    job = start(tmp_path, *SHORT_RUN, QUICK_LIVENESS, *held_at(hold, 3, release_on_signal=False))
    wait_for_hold(hold, 2, job)
    pids = local_ranks(tmp_path, job, 2)
    # Ctrl-Z's SIGTSTP stops a foreground job; the kernel drops it for a process group that, as here, has no parent
    # in its session.
    os.killpg(job.pid, signal.SIGSTOP)
    while not all(is_frozen(pid) for pid in pids):
        time.sleep(0.05)
    time.sleep(2 * PEER_TIMEOUT)  # the suspension itself: on the wall clock, which a process's timeouts follow
    os.killpg(job.pid, signal.SIGCONT)  # fg
    hold.unlink()
    result = ended(tmp_path, job, within=600)
    assert result["status"] == 0, result["output"]
    assert "error:" not in result["output"]


def test_a_frozen_rank_0_is_named_and_ended_by_its_node_within_peer_timeout(tmp_path):
    hold = tmp_path / "hold"
    hold.touch()
    job = start(tmp_path, *SHORT_RUN, QUICK_LIVENESS, *held_at(hold, 3, release_on_signal=False))
    wait_for_hold(hold, 2, job)
    one = local_ranks(tmp_path, job, 2)[1]
    os.kill(job.pid, signal.SIGSTOP)  # a hung process that never runs again
    hold.unlink()  # rank 1 goes on to its next step, and waits for rank 0 in its gradient all-reduce
    result = ended(tmp_path, job)
    assert result["status"] == -signal.SIGKILL
    wait_gone(one, 60)
    paragraph = last_paragraph(result["output"])
    assert paragraph.startswith(
        f"error: the job stopped: rank 0 (local rank 0, pid {job.pid}) of node 0 ({socket.gethostname()}) is frozen "
        "(stopped by SIGSTOP, Ctrl-Z or a debugger, with no SIGCONT since): no heartbeat, for longer than peer_timeout "
        f"(0:00:{PEER_TIMEOUT:02d}), so this node stopped rather than wait out the collective timeout (0:30:00). "
        "It was ended with the job."
    ), paragraph
    assert result["output"].count("error: ") == 1
    assert result["left"] == []


@pytest.fixture(scope="module")
def two_nodes_stopped(tmp_path_factory, two_hosts_for_module):
    """A job of two network-namespace hosts, one process each, with one project directory (shared storage), stopped
    twice through node 1 (a worker) and started again by the same commands: its launcher killed (SIGKILL) while both
    hold at INTERRUPT_STEP, then Ctrl-C to it at TERMINATE_STEP."""
    project = copy_project(tmp_path_factory.mktemp("two") / "project")
    hosts = two_hosts_for_module
    settings = {"MASTER_ADDR": hosts[0]["address"], "MASTER_PORT": "29500", "NUM_NODES": "2"}
    found = {}
    for stop, step in (("killed", INTERRUPT_STEP), ("interrupted", TERMINATE_STEP)):
        hold = project / f"{stop}.hold"
        hold.touch()
        launchers = [
            launch(project, "cpu:1", rank, *RUN, *held_at(hold, step), netns=hosts[rank]["netns"], **settings)
            for rank in (0, 1)
        ]
        wait_for_hold(hold, 2, launchers[0])
        launchers[1].send_signal(signal.SIGKILL if stop == "killed" else signal.SIGINT)
        hold.unlink()  # node 0, which the signal does not reach, goes on to the ranks' next agreement
        outputs = [launcher.communicate(timeout=300)[0] for launcher in launchers]
        found[stop] = {
            "outputs": outputs,
            "statuses": [launcher.returncode for launcher in launchers],
            "checkpoint": saved_in(project),
            "left": processes_in(project),
        }
    return found


def test_a_killed_workers_launcher_stops_both_nodes_with_last_ckpt_saved(two_nodes_stopped):
    killed = two_nodes_stopped["killed"]
    assert killed["statuses"] == [0, -signal.SIGKILL], killed["outputs"]
    for output in killed["outputs"]:  # node 1's, written after its launcher was gone, by the tee it left
        stop = stop_line([line for line in output.splitlines() if line.startswith("Stopped by")][-1])
        assert stop[1] == "a signal (SIGTERM) to node 1" and "again on every node" in stop[0]
        assert int(stop[3]) == killed["checkpoint"]["global_step"] >= INTERRUPT_STEP
    assert killed["left"] == [], "processes of the job left running"


def test_ctrl_c_to_a_workers_launcher_is_said_by_every_node_and_both_resume(two_nodes_stopped):
    step = two_nodes_stopped["killed"]["checkpoint"]["global_step"]
    interrupted = two_nodes_stopped["interrupted"]
    assert interrupted["statuses"] == [130, 130], interrupted["outputs"]
    assert f"(epoch 0, step {step})." in interrupted["outputs"][0], "the same command did not resume"
    for output in interrupted["outputs"]:
        stop = stop_line([line for line in output.splitlines() if line.startswith("Stopped by")][-1])
        assert stop[1] == "Ctrl-C (SIGINT) to node 1" and "again on every node" in stop[0]
        assert int(stop[3]) == interrupted["checkpoint"]["global_step"] >= TERMINATE_STEP
        assert "error:" not in output
    assert "node 1: interrupted, stopping training: sending SIGINT to" in interrupted["outputs"][1]
    assert interrupted["left"] == [], "processes of the job left running"


def test_the_launcher_kills_a_training_process_stopped_for_frozen_timeout(tmp_path):
    """One process on the node: no other one there ends it (the other nodes would stop after peer_timeout)."""
    node = copy_project(tmp_path / "node")
    port = str(free_port())
    hold = node / "hold"
    hold.touch()
    args = [*SHORT_RUN, *held_at(hold, 3, release_on_signal=False)]
    launcher = launch(node, "cpu:1", 0, *args, FROZEN_TIMEOUT="3", MASTER_PORT=port)
    wait_for_hold(hold, 1, launcher)
    commands = {pid: Path(f"/proc/{pid}/cmdline").read_bytes() for pid in processes_in(node)}
    [training] = [pid for pid, line in commands.items() if b"cli.py" in line and b"run_ddp_train" not in line]
    os.kill(training, signal.SIGSTOP)
    output, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 128 + signal.SIGKILL, output
    assert f"node 0: training (pid {training}) had been stopped for 3s: killed it" in output
    assert_everything_stopped(node, port)


def test_output_piped_into_head_stops_the_run_with_one_paragraph_and_no_traceback(tmp_path):
    # head ends after the first 100 bytes of the progress bar: training's next write finds the pipe closed.
    cli = shlex.join([sys.executable, str(REPO / "cli.py"), "fit", "-c", DDP_YAML, "--trainer.accelerator=cpu"])
    command = f"{cli} --trainer.max_epochs=1 2>err | head -c 100 >/dev/null; exit ${{PIPESTATUS[0]}}"
    status = subprocess.run(
        ["bash", "-c", command], cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}
    ).returncode
    err = (tmp_path / "err").read_text()
    assert status == 1, err
    assert last_paragraph(err) == (
        "error: the output of cli.py was closed by whoever read it (a pipe into head, say), so the run stopped. The "
        "same command resumes from the run's last checkpoint; to read part of the output while training goes on, send "
        "it to a file (python cli.py fit ... > train.log 2>&1) and read that."
    )
    assert job_processes(tmp_path) == []


def test_a_training_step_that_skips_a_batch_under_ddp_stops_with_one_paragraph(tmp_path):
    module = ["--model=tests.zoo.SkippingClassifier", "--data=tests.zoo.Blobs", "--monitor=val_loss"]
    result = ended(tmp_path, start(tmp_path, *module, "--trainer.max_epochs=1"), within=300)
    assert result["status"] == 1, result["output"]
    assert last_paragraph(result["output"]) == f"error: {SKIPPED_STEP}"
    assert result["output"].count("error: ") == 1
    assert result["left"] == []


def test_a_rank_stalled_on_another_host_is_named_in_both_nodes_logs_and_both_stop(tmp_path, two_hosts_for_module):
    project = copy_project(tmp_path / "project")
    hosts = two_hosts_for_module
    settings = {"MASTER_ADDR": hosts[0]["address"], "MASTER_PORT": "29501", "NUM_NODES": "2"}
    stall = project / "stall"
    stall.touch()
    args = [
        "--trainer.max_epochs=1",
        "--data=tests.zoo.FileSamples",
        "--data.init_args.num_workers=0",
        f"--data.init_args.stall_file={stall}",
        "--data.init_args.stall_rank=1",
        "--trainer.strategy.init_args.stall_report=0:00:04",
        "--trainer.strategy.init_args.stall_timeout=0:00:08",
    ]
    launchers = [launch(project, "cpu:1", rank, *args, netns=hosts[rank]["netns"], **settings) for rank in (0, 1)]
    try:
        ended_nodes = [(launcher.communicate(timeout=300)[0], launcher.returncode) for launcher in launchers]
    finally:
        stall.unlink()
    for node, (output, status) in enumerate(ended_nodes):
        assert status == 1, output
        log = (project / "logs" / "nodes" / f"node{node}.log").read_text()
        assert "warning: rank 1 (local rank 0, pid " in log and f"of node 1 (vm, {hosts[1]['address']})" in log, log
        assert re.search(r'File ".*/tests/zoo\.py", line \d+, in __getitem__', log), log
        paragraph = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(paragraph) == 1 and paragraph[0].startswith("error: the job stopped: rank 1 (local rank 0, pid ")
    assert processes_in(project) == []


def test_a_frozen_node_is_named_by_the_other_and_ended_by_its_own_launcher(tmp_path, two_hosts_for_module):
    project = copy_project(tmp_path / "project")
    hosts = two_hosts_for_module
    settings = {"MASTER_ADDR": hosts[0]["address"], "MASTER_PORT": "29502", "NUM_NODES": "2", "FROZEN_TIMEOUT": "5"}
    hold = project / "hold"
    hold.touch()
    args = [*SHORT_RUN, QUICK_LIVENESS, *held_at(hold, 3, release_on_signal=False)]
    launchers = [launch(project, "cpu:1", rank, *args, netns=hosts[rank]["netns"], **settings) for rank in (0, 1)]
    wait_for_hold(hold, 2, launchers[0])
    [frozen] = [
        pid
        for pid in processes_in(project)
        if Path(f"/proc/{pid}/environ").read_bytes().find(b"NODE_RANK=1\0") >= 0
        and b"cli.py" in Path(f"/proc/{pid}/cmdline").read_bytes()
        and b"run_ddp_train" not in Path(f"/proc/{pid}/cmdline").read_bytes()
    ]
    os.kill(frozen, signal.SIGSTOP)
    hold.unlink()
    (zero, zero_status), (one, one_status) = [
        (launcher.communicate(timeout=300)[0], launcher.returncode) for launcher in launchers
    ]
    assert zero_status == 1, zero
    assert re.search(rf"error: the job lost node 1 \(vm, {hosts[1]['address']}\), last heard from at ", zero), zero
    assert one_status == 128 + signal.SIGKILL, one
    assert f"node 1: training (pid {frozen}) had been stopped for 5s: killed it" in one
    assert processes_in(project) == []
