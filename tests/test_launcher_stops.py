"""Stops that reach one node's launcher (scripts/run_ddp_train.sh cpu:2 0) as a whole or kill it outright: SIGTERM to
all its processes, its tee included (GNU ``timeout``, systemd); SIGKILL to the launcher alone (the out-of-memory
killer, ``kill -9``); Ctrl-C twice. One run is stopped each way in turn, and resumed by the same command."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.helpers import assert_everything_stopped, copy_project, free_port, launcher_env, wait_for_hold
from tests.helpers.one_node import (
    HANGUP_STEP,
    INTERRUPT_STEP,
    RUN,
    STEPS_PER_EPOCH,
    TERMINATE_STEP,
    held_at,
    saved_in,
    stop_line,
)

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def launcher_stops(tmp_path_factory):
    """One node's launcher, in a session of its own as a shell starts it, stopped three ways by the same command:
    SIGTERM to all its processes (its tee included) at INTERRUPT_STEP, SIGKILL to the launcher alone at
    TERMINATE_STEP, then Ctrl-C twice at HANGUP_STEP (the second once the first reached training)."""
    node = copy_project(tmp_path_factory.mktemp("launcher_stops"))
    port = str(free_port())
    log = node / "logs" / "nodes" / "node0.log"
    found = {}
    for stop, step in (("terminated", INTERRUPT_STEP), ("killed", TERMINATE_STEP), ("twice", HANGUP_STEP)):
        hold = node / f"{stop}.hold"
        hold.touch()
        command = [str(node / "scripts" / "run_ddp_train.sh"), "cpu:2", "0", *RUN, "--trainer.max_epochs=3"]
        command += held_at(hold, step, release_on_signal=stop != "twice")
        logged = len(log.read_text()) if log.exists() else 0
        launcher = subprocess.Popen(
            command,
            env=launcher_env(MASTER_PORT=port),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        wait_for_hold(hold, 2, launcher)
        if stop == "terminated":
            os.killpg(launcher.pid, signal.SIGTERM)
        elif stop == "killed":
            launcher.kill()
            hold.unlink()  # the rank the signal did not reach goes on to the ranks' next agreement
        else:
            os.killpg(launcher.pid, signal.SIGINT)
            while not Path(f"{hold}.signalled.rank0").exists():
                time.sleep(0.02)
            os.killpg(launcher.pid, signal.SIGINT)
        output = launcher.communicate(timeout=300)[0]  # once every process writing into it has ended
        hold.unlink(missing_ok=True)
        assert_everything_stopped(node, port)
        found[stop] = {"status": launcher.returncode, "output": output, "log": log.read_text()[logged:]}
        found[stop]["checkpoint"] = saved_in(node)
    return found


def test_sigterm_to_every_process_of_the_launcher_saves_and_the_paragraph_reaches_terminal_and_log(launcher_stops):
    terminated = launcher_stops["terminated"]
    assert terminated["status"] == 0, terminated["output"]
    for seen in (terminated["output"], terminated["log"]):
        stop = stop_line([line for line in seen.splitlines() if line.startswith("Stopped by")][-1])
        assert stop[1] == "a signal (SIGTERM)" and int(stop[3]) == terminated["checkpoint"]["global_step"]
    assert int(stop[2]) == 0 and INTERRUPT_STEP <= int(stop[3]) < STEPS_PER_EPOCH


def test_training_saves_and_ends_when_its_launcher_is_killed(launcher_stops):
    killed = launcher_stops["killed"]
    assert killed["status"] == -signal.SIGKILL
    step = launcher_stops["terminated"]["checkpoint"]["global_step"]
    assert f"checkpoints/last.ckpt (epoch 0, step {step})." in killed["log"], "the same command did not resume"
    stop = stop_line(killed["log"])  # the paragraph ends the node log, after the launcher was gone
    assert stop[1] == "a signal (SIGTERM)" and int(stop[3]) == killed["checkpoint"]["global_step"] >= TERMINATE_STEP


def test_ctrl_c_twice_to_the_launcher_says_on_lines_of_their_own_what_was_kept(launcher_stops):
    twice = launcher_stops["twice"]
    assert twice["status"] == 130, twice["output"]
    said = (
        "error: node 0 was stopped at once: nothing more was saved. Run the same command again to resume from the "
        "run's last checkpoint."
    )
    for seen in (twice["output"], twice["log"]):
        lines = seen.splitlines()
        assert said in lines, seen
        assert any(line.startswith("node 0: interrupted again: sending SIGKILL to ") for line in lines), seen
    assert "Killed" not in twice["output"], "bash's own line on a killed process"
    assert twice["checkpoint"]["global_step"] < HANGUP_STEP, "a save after the first Ctrl-C"
