"""scripts/slurm.sbatch on a real Slurm (tests/helpers/slurm_cluster.py: two nodes on this machine) as a user submits it
from a fresh clone, on a cluster without GPUs: one job of 2 nodes x 2 tasks, stopped by the time-limit signal at
a step it holds at, requeued, resumed and run to its end."""

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from tests.helpers import REPO, copy_project, free_port, launcher_env, probe_args, probe_records
from tests.helpers.slurm_cluster import SlurmCluster, install

HOLD_STEP = 10
NUM_TRAIN = 16384  # 64 steps per epoch on each of the 4 ranks: the signal's checkpoint lands in epoch 0
STEPS_PER_EPOCH = NUM_TRAIN // (64 * 4)
CPUS_PER_TASK = 1  # 2 tasks per node on this machine's cores
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")


@pytest.fixture(scope="module")
def slurm():
    install()
    cluster = SlurmCluster()
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def requeued(slurm, tmp_path_factory):
    """The job, held at HOLD_STEP until signalled as ``--signal=B:USR1`` does, requeued, and finished: the
    project, the job's id, its output file, its fields when it ended, and where the probe wrote."""
    root = tmp_path_factory.mktemp("slurm")
    project = copy_project(root / "project")
    hold = root / "usr1.hold"
    hold.touch()
    submitted = slurm.run(
        "sbatch",
        "--parsable",
        "--gpus-per-node=0",  # the cluster has no GPUs (no gres): docs/multi-node.md's way in for a CPU cluster
        f"--cpus-per-task={CPUS_PER_TASK}",
        "scripts/slurm.sbatch",
        "--trainer.max_epochs=1",  # the requeued attempt trains the rest of epoch 0
        f"--data.init_args.num_train={NUM_TRAIN}",
        *probe_args(root / "probe"),
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        f"--trainer.callbacks.step={HOLD_STEP}",
        f"--trainer.callbacks.hold_file={hold}",
        cwd=project,
        # Both "nodes" are this machine: their master at 127.0.0.1 (Lightning takes MASTER_ADDR before the node
        # list), a free port, and loopback for gloo.
        env=launcher_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="lo"),
    )
    job_id = submitted.strip().split(";")[0]
    output = project / f"slurm-ddp-{job_id}.out"
    markers = [Path(f"{hold}.rank{rank}") for rank in range(4)]
    slurm.wait_for_job(
        job_id,
        lambda job: all(m.exists() for m in markers) or job["JobState"] not in ("PENDING", "RUNNING"),
        "holding at its step",
    )
    assert all(m.exists() for m in markers), f"the job ended before holding:\n{read(output)}"
    slurm.run("scancel", "--batch", "--signal=USR1", job_id)  # what --signal=B:USR1@120 sends the batch script
    slurm.wait_for_job(job_id, lambda job: job["Restarts"] == "1", "requeued")
    hold.unlink()  # the requeued attempt trains on to the end
    job = slurm.wait_for_job(job_id, lambda job: job["JobState"] in ENDED and job["Restarts"] == "1", "done")
    return project, job_id, read(output), job, root / "probe"


def read(path: Path) -> str:
    return path.read_text() if path.exists() else f"({path} was not written)"


def test_node_count_is_written_once():
    script = (REPO / "scripts" / "slurm.sbatch").read_text()
    assert len(re.findall(r"^#SBATCH --nodes=\d+$", script, flags=re.MULTILINE)) == 1
    assert "--trainer.num_nodes=$SLURM_NNODES" in script
    assert not re.search(r"num_nodes=\d", script)


@pytest.mark.distributed
def test_a_job_from_a_fresh_clone_trains_on_every_task_and_exits_0(requeued):
    project, _, output, job, probe = requeued
    assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), f"{job}\n{output}"
    records = probe_records(probe, 4)
    assert [(r["global_rank"], r["world_size"], r["backend"]) for r in records] == [(i, 4, "gloo") for i in range(4)]
    assert [(r["node_rank"], r["local_rank"]) for r in records] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for record in records[1:]:
        for name, value in records[0]["params"].items():
            assert torch.equal(value, record["params"][name]), name
    # The resumed attempt trained the rest of epoch 0: every row once, on one rank.
    rows = [{row.numpy().tobytes() for row in r["inputs"]} for r in records]
    assert sum(len(r) for r in rows) == len(set().union(*rows)) > 0, "ranks read overlapping shards"
    assert (project / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt").is_file()


@pytest.mark.distributed
def test_each_task_is_bound_to_its_cpus_per_task_and_runs_that_many_threads(requeued):
    *_, probe = requeued
    records = probe_records(probe, 4)
    assert [r["threads"] for r in records] == [CPUS_PER_TASK] * 4, "a task did not run --cpus-per-task threads"
    assert [len(r["cores"]) for r in records] == [CPUS_PER_TASK] * 4, "a task was not bound to --cpus-per-task cores"
    for node in (records[:2], records[2:]):
        assert not set(node[0]["cores"]) & set(node[1]["cores"]), "two tasks of a node share a core"


@pytest.mark.distributed
def test_the_time_limit_signal_requeues_the_job_which_resumes_and_keeps_both_attempts_output(requeued):
    _, job_id, output, job, _ = requeued
    assert job["Restarts"] == "1", job
    stopped = re.search(r"Stopped by a signal \(SIG\w+\) at epoch 0, step (\d+): saved \S+/last\.ckpt", output)
    assert stopped, output
    step = int(stopped.group(1))
    assert HOLD_STEP < step < STEPS_PER_EPOCH, "the checkpoint is not from where the signal arrived"
    first, requeue, second = (
        output.index(f"job {job_id} attempt 1 on"),
        output.index(f"requeueing job {job_id}; it resumes from the run's last checkpoint"),
        output.index(f"job {job_id} attempt 2 on"),
    )
    assert first < stopped.start() < requeue < second, output
    assert re.search(rf"Resuming from \S+/last\.ckpt \(epoch 0, step {step}\)\.", output[second:]), output


def sbatch_alone(tmp_path: Path, **slurm: str) -> subprocess.CompletedProcess:
    """The job script run by bash with the variables SLURM would set, and no srun: its checks before it starts."""
    env = {"PATH": os.environ["PATH"], "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-a", **slurm}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm.sbatch")], env=env, capture_output=True, text=True, cwd=tmp_path
    )


def test_a_job_submitted_outside_the_project_says_where_to_submit_it(tmp_path):
    done = sbatch_alone(tmp_path, SLURM_SUBMIT_DIR=str(tmp_path), SLURM_NTASKS_PER_NODE="2")
    assert done.returncode == 2
    assert done.stderr == (
        f"error: the job was submitted from {tmp_path}, which holds no cli.py. Submit it from the project root: "
        "cd <project> && sbatch scripts/slurm.sbatch\n"
    )


@pytest.mark.parametrize("gpus", ["4", "a100:4"])
def test_a_job_with_more_gpus_than_tasks_per_node_is_refused(gpus):
    done = sbatch_alone(REPO, SLURM_SUBMIT_DIR=str(REPO), SLURM_NTASKS_PER_NODE="2", SLURM_GPUS_PER_NODE=gpus)
    assert done.returncode == 2
    assert done.stderr == (
        f"error: the job has --gpus-per-node={gpus} but --ntasks-per-node=2; Lightning runs one process per task "
        "and per GPU. Give both the same number.\n"
    )
