"""A one-node job as a user starts it (``python cli.py fit`` with N CPU processes), its processes by local rank, and
how its output ends once they are gone."""

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tests.helpers import DDP_YAML, REPO, free_port, processes_in, wait_for_hold
from training.checkpoints.preemption import CHECK_PERIOD

# Far longer than any of these runs may take to stop: only their own words may end them.
JOIN_TIMEOUT = "0:10:00"
# torch's C++ log lines hold their level and date, after the rank in a process group: [rank1]:[W1125 15:47:41.1234 ...
TRACE = re.compile(r"Traceback|Exception in thread|frame #|terminate called|\[[WEF]\d{4} \d\d:\d\d:\d\d")


def start(
    workdir: Path,
    *args: str,
    devices: int = 2,
    subcommand: str = "fit",
    terminal: Callable[[], None] | None = None,
    **settings: str,
) -> subprocess.Popen:
    """``python cli.py fit`` (or ``subcommand``) with ``devices`` CPU processes in ``workdir``, with environment
    ``settings`` (a free MASTER_PORT unless given), in a session of its own as a shell starts a foreground job (a signal
    to its process group reaches every process, as Ctrl-C in a terminal does); the output of all of them goes to
    workdir/output. With ``terminal`` (tests/test_everyday_stops.py), standard input and output are the terminal that
    call makes the session's own in the new process."""
    workdir.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(REPO / "cli.py"), subcommand, "-c", DDP_YAML, "--trainer.accelerator=cpu"]
    command += [f"--trainer.devices={devices}", f"--trainer.strategy.init_args.join_timeout={JOIN_TIMEOUT}", *args]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(free_port()), **settings}
    if terminal is not None:
        return subprocess.Popen(command, cwd=workdir, env=env, start_new_session=True, preexec_fn=terminal)
    with (workdir / "output").open("w") as output:
        return subprocess.Popen(
            command, cwd=workdir, env=env, stdout=output, stderr=subprocess.STDOUT, start_new_session=True
        )


def local_ranks(workdir: Path, rank_zero: subprocess.Popen, devices: int) -> list[int]:
    """The pids of the job's processes by local rank, once rank 0 has started the others (DataLoader workers, which
    carry their process's LOCAL_RANK, left out)."""
    while True:
        found = {0: rank_zero.pid}
        for pid in processes_in(workdir):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                worker = Path(f"/proc/{pid}/comm").read_text().strip() == "pt_data_worker"
            except OSError:
                continue
            given = [item[len(b"LOCAL_RANK=") :] for item in environ if item.startswith(b"LOCAL_RANK=")]
            if pid != rank_zero.pid and given and not worker:
                found[int(given[0])] = pid
        if len(found) == devices:
            return [found[rank] for rank in range(devices)]
        assert rank_zero.poll() is None, (workdir / "output").read_text()
        time.sleep(0.05)


def gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pid: int, within: float) -> float:
    """Seconds until ``pid`` ended; fails once ``within`` seconds have passed."""
    started = time.monotonic()
    while not gone(pid):
        assert time.monotonic() - started < within, f"pid {pid} still runs after {within} s"
        time.sleep(0.05)
    return time.monotonic() - started


def last_paragraph(output: str) -> str:
    """The paragraph the output ends with, after no traceback or C++ trace."""
    assert not traces(output), output
    lines = output.rstrip().splitlines()
    assert lines[-1].startswith("error: "), output
    return lines[-1]


def traces(output: str) -> list[str]:
    """The lines of a Python traceback, a thread's uncaught exception, or a C++ trace or log line of torch's."""
    return [line for line in output.splitlines() if TRACE.search(line)]


# A run stopped at a known step: the stops of tests/test_everyday_stops.py and the files that share its run.
STEPS_PER_EPOCH = 64  # 8192 samples / (64 per batch * 2 processes)
# Every step sleeps at least this long, so the ranks agree on stopping at most every CHECK_PERIOD / PACE steps after
# a signal: 40, which keeps a stop asked for 10 steps into an epoch inside that epoch however fast the machine is.
PACE = CHECK_PERIOD / 40
RUN = [
    "--trainer.max_epochs=2",
    "--trainer.callbacks+=tests.helpers.probe.SlowDown",
    f"--trainer.callbacks.seconds={PACE}",
    "--trainer.callbacks.progress_file=progress.step",
]
INTERRUPT_STEP, TERMINATE_STEP, HANGUP_STEP = 10, STEPS_PER_EPOCH + 10, 2 * STEPS_PER_EPOCH + 10
# The same samples and steps, read by 2 DataLoader workers per rank, for 3 epochs.
READ_BY_WORKERS = [
    *RUN,
    "--trainer.max_epochs=3",
    "--data=tests.zoo.FileSamples",
    "--data.init_args.num_samples=8192",
    "--data.init_args.batch_size=64",
]


def signalled_at(workdir: Path, hold: Path, step: int, signum: int, *args: str) -> dict:
    """What a job of ``args`` left once its process group was sent ``signum`` while its 2 ranks held at ``step``."""
    hold.touch()
    job = start(workdir, *args, *held_at(hold, step))
    wait_for_hold(hold, 2, job)
    os.killpg(job.pid, signum)
    result = ended(workdir, job)
    hold.unlink(missing_ok=True)
    return result


def held_at(hold: Path, step: int, release_on_signal: bool = True) -> list[str]:
    return [
        "--trainer.callbacks+=tests.helpers.probe.HoldAtStep",
        f"--trainer.callbacks.step={step}",
        f"--trainer.callbacks.hold_file={hold}",
        f"--trainer.callbacks.release_on_signal={release_on_signal}",
    ]


def ended(workdir: Path, job: subprocess.Popen, within: float = 120) -> dict:
    """Once the job's first process has ended and the others with it: what it left."""
    job.wait(timeout=within)
    left = [pid for pid in job_processes(workdir) if not gone(pid)]
    run = workdir / "logs" / "toy" / "default"
    checkpoints = sorted(path.name for path in (run / "checkpoints").glob("*.ckpt")) if run.exists() else []
    return {
        "status": job.returncode,
        "output": (workdir / "output").read_text(),
        "left": left,
        "run": run,
        "checkpoints": checkpoints,
    }


def job_processes(workdir: Path) -> list[int]:
    deadline = time.monotonic() + 60
    while True:
        pids = [pid for pid in processes_of(workdir) if not gone(pid)]
        if not pids or time.monotonic() > deadline:
            return pids
        time.sleep(0.05)


def processes_of(workdir: Path) -> list[int]:
    found = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if Path(os.readlink(proc / "cwd")) == workdir:
                found.append(int(proc.name))
        except OSError:
            continue
    return found


def saved(result: dict) -> dict:
    """last.ckpt of the run, loaded as a resume loads it; every tensor of its weights finite."""
    return saved_in(result["run"].parents[2])


def saved_in(workdir: Path) -> dict:
    checkpoint = torch.load(workdir / "logs" / "toy" / "default" / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.isfinite(value).all() for value in checkpoint["state_dict"].values())
    return checkpoint


def stop_line(output: str) -> re.Match:
    lines = output.rstrip().splitlines()
    assert not traces(output), output
    found = re.fullmatch(
        r"Stopped by (.+) at epoch (\d+), step (\d+): saved logs/toy/default/checkpoints/last\.ckpt\. "
        r"Run the same command again(?: on every node)? to resume from there\.",
        lines[-1],
    )
    assert found, output
    return found
