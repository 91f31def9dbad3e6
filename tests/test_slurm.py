"""scripts/slurm.sbatch, run under stand-ins for srun (starts the tasks with srun's variables, passes signals
on to them) and scontrol (records what it was asked)."""

import os
import re
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, check_ranks, copy_project, probe_args, wait_for_hold
from training.preemption import CHECK_PERIOD

CORES = len(os.sched_getaffinity(0))
HOLD_STEP = 10

FAKE_SRUN = """#!/usr/bin/env bash
# Starts SLURM_NNODES x SLURM_NTASKS_PER_NODE copies of the command, each with the variables srun sets,
# and passes USR1 and TERM on to them, as srun does.
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    for ((local = 0; local < SLURM_NTASKS_PER_NODE; local++)); do
        SLURM_NTASKS=$((SLURM_NNODES * SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$node SLURM_LOCALID=$local \\
            SLURM_PROCID=$((node * SLURM_NTASKS_PER_NODE + local)) "$@" &
        pids+=($!)
    done
done
trap 'kill -USR1 "${pids[@]}" 2>/dev/null' USR1
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM
status=0
for pid in "${pids[@]}"; do
    while true; do
        wait "$pid" && break
        code=$?
        kill -0 "$pid" 2>/dev/null || { status=$code; break; }  # else a trapped signal interrupted the wait
    done
done
exit $status
"""

FAKE_SCONTROL = """#!/usr/bin/env bash
echo "$*" >>"$SCONTROL_LOG"
"""


def sbatch(tmp_path: Path, *args: str, nodes: int = 2) -> tuple[subprocess.Popen, Path]:
    """Start scripts/slurm.sbatch in a copy of the project as a job of ``nodes`` nodes with 2 tasks each."""
    project = copy_project(tmp_path / "project")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod((bin_dir / name).stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{bin_dir}:{sys.exec_prefix}/bin:/usr/bin:/bin",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(project),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ddp",
        "SLURM_NNODES": str(nodes),
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODELIST": "127.0.0.1",
        # All of this machine's cores (torch takes no more): Lightning alone would give each task half.
        "SLURM_CPUS_PER_TASK": str(CORES),
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
    }
    command = ["bash", str(project / "scripts" / "slurm.sbatch"), "--trainer.accelerator=cpu", *args]
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    return process, project


def test_node_count_is_written_once():
    script = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert len(re.findall(r"^#SBATCH --nodes=\d+$", script, flags=re.MULTILINE)) == 1
    assert "--trainer.num_nodes=$SLURM_NNODES" in script
    assert not re.search(r"num_nodes=\d", script)


@pytest.mark.distributed
def test_job_trains_on_every_task_slurm_starts(tmp_path):
    process, project = sbatch(tmp_path, "--trainer.max_epochs=1", *probe_args(tmp_path / "probe"))
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    records = check_ranks(tmp_path / "probe")
    assert [r["threads"] for r in records] == [CORES] * 4, "a task did not use its --cpus-per-task cores"
    assert (project / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").is_file()
    assert not (tmp_path / "scontrol.log").exists(), "a job that ran to its end was requeued"


@pytest.mark.distributed
def test_the_time_limit_signal_saves_a_checkpoint_and_requeues_the_job(tmp_path):
    hold = tmp_path / "usr1.hold"
    hold.touch()
    process, project = sbatch(
        tmp_path,
        "--trainer.max_epochs=5",
        "--trainer.callbacks+=tests.probe.SlowDown",
        f"--trainer.callbacks.seconds={CHECK_PERIOD / 40}",  # the ranks agree on stopping within 40 steps
        f"--trainer.callbacks.progress_file={tmp_path / 'step'}",
        "--trainer.callbacks+=tests.probe.HoldAtStep",
        f"--trainer.callbacks.step={HOLD_STEP}",
        f"--trainer.callbacks.hold_file={hold}",
        nodes=1,  # srun passes the signal to every task alike; one node of two tasks shows it
    )
    wait_for_hold(hold, 2, process)
    process.send_signal(signal.SIGUSR1)  # what --signal=B:USR1@120 sends the batch script
    output, _ = process.communicate(timeout=300)
    assert process.returncode == 0, output

    checkpoint = torch.load(project / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt", weights_only=True)
    assert HOLD_STEP <= checkpoint["global_step"] <= HOLD_STEP + 40, (
        "the checkpoint is not from where the signal arrived"
    )
    assert "requeueing job 4242" in output
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
