"""scripts/slurm.sbatch, run under a stand-in for srun that starts the tasks with srun's variables."""

import re
import stat
import subprocess
import sys

import pytest

from tests.cluster import check_four_ranks, probe_args
from tests.conftest import REPO, copy_project

pytestmark = pytest.mark.distributed

FAKE_SRUN = """#!/usr/bin/env bash
# Starts SLURM_NNODES x SLURM_NTASKS_PER_NODE copies of the command, each with the variables srun sets.
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    for ((local = 0; local < SLURM_NTASKS_PER_NODE; local++)); do
        SLURM_NTASKS=$((SLURM_NNODES * SLURM_NTASKS_PER_NODE)) SLURM_NODEID=$node SLURM_LOCALID=$local \\
            SLURM_PROCID=$((node * SLURM_NTASKS_PER_NODE + local)) "$@" &
        pids+=($!)
    done
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


def test_node_count_is_written_once():
    script = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert len(re.findall(r"^#SBATCH --nodes=\d+$", script, flags=re.MULTILINE)) == 1
    assert "--trainer.num_nodes=$SLURM_NNODES" in script
    assert not re.search(r"num_nodes=\d", script)


def test_job_trains_on_every_task_slurm_starts(tmp_path):
    project = copy_project(tmp_path / "project")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    env = {
        "PATH": f"{bin_dir}:{sys.exec_prefix}/bin:/usr/bin:/bin",
        "PYTHON": sys.executable,
        "SLURM_SUBMIT_DIR": str(project),
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "ddp",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODELIST": "127.0.0.1",
    }
    done = subprocess.run(
        [
            "bash",
            str(project / "scripts" / "slurm.sbatch"),
            "--trainer.accelerator=cpu",
            "--trainer.max_epochs=1",
            "--trainer.enable_progress_bar=false",
            *probe_args(tmp_path / "probe"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    check_four_ranks(tmp_path / "probe")
    assert (project / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").is_file()
