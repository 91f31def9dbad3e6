"""A one-node job as a user starts it (``python cli.py fit`` with N CPU processes), its processes by local rank, and
how its output ends once they are gone."""

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tests.helpers import DDP_YAML, REPO, free_port, processes_in

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
