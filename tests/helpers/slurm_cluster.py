"""A real Slurm cluster on this machine for the tests: munged, slurmctld and two slurmd ("nodes" on loopback,
each with this machine's cores), with their own key, config, state and logs in a temporary directory. Debian's
packages (Slurm 22.05) are installed when missing, without starting the system's own daemons."""

import os
import pwd
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.helpers import free_port

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel", "sinfo")
SEARCH_PATH = f"{os.environ.get('PATH', '')}:/usr/sbin:/usr/bin:/sbin"
# Two slurmd on this machine (Debian builds Slurm with MULTIPLE_SLURMD), "nodes" whose names resolve nowhere: a
# job's processes find their master through MASTER_ADDR=127.0.0.1 in the job's environment.
NODES = ("node1", "node2")
# How long a requeued job waits before it may start again: Slurm's default of 120 s (AuthInfo cred_expire)
# with a scheduler that looks at pending jobs once a minute leaves it pending about 3 minutes.
REQUEUE_DELAY = 5
# Finished jobs stay visible to scontrol this long; there is no accounting database to ask later.
MIN_JOB_AGE = 3600


def program(name: str) -> str:
    found = shutil.which(name, path=SEARCH_PATH)
    assert found, f"{name} is not installed"
    return found


def install() -> None:
    """Install Slurm and MUNGE from Debian's packages unless present; skip where that cannot be done."""
    if os.geteuid() != 0:
        pytest.skip("a Slurm cluster of the tests' own needs root: slurmd starts every job as its user")
    if all(shutil.which(name, path=SEARCH_PATH) for name in PROGRAMS):
        return
    if not shutil.which("apt-get"):
        pytest.skip(f"Slurm is not installed and there is no apt-get to install it: {' '.join(PACKAGES)}")
    # A policy-rc.d that refuses keeps the packages from starting the system's own munged and slurmd.
    policy = Path("/usr/sbin/policy-rc.d")
    ours = not policy.exists()
    if ours:
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        wait = ["-o", "DPkg::Lock::Timeout=600"]  # another test may be installing its own packages
        for command in (["apt-get", *wait, "update", "-qq"], ["apt-get", *wait, "install", "-y", "-qq", *PACKAGES]):
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
            assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}{done.stderr}"
    finally:
        if ours:
            policy.unlink()


class SlurmCluster:
    """Start with ``start()``, stop with ``stop()``; ``env`` points Slurm's commands at this cluster."""

    def __init__(self) -> None:
        # Outside pytest's temporary directories, which are private to their owner: munged refuses a socket
        # directory that others cannot search, and the tests kill processes left running inside them.
        self.root = Path(tempfile.mkdtemp(prefix="slurm-test-"))
        self.root.chmod(0o755)
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf), "PATH": SEARCH_PATH}
        self.daemons: dict[str, subprocess.Popen] = {}  # by the name of their output's file

    def start(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o755)
        (munge / "key").write_bytes(os.urandom(1024))
        (munge / "key").chmod(0o400)
        self.socket = munge / "socket"
        self._daemon(
            "munged",
            [program("munged"), "--foreground", f"--key-file={munge / 'key'}", f"--socket={self.socket}"]
            + [f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}", f"--log-file={munge / 'log'}"],
        )
        self._wait(lambda: self.socket.exists(), "munged to open its socket", "munged")
        self.conf.write_text(self._config(ports=[free_port() for _ in range(1 + len(NODES))]))
        self._daemon("slurmctld", [program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in NODES:
            self._daemon(f"slurmd-{node}", [program("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._nodes_idle, f"nodes {', '.join(NODES)} to be idle", "slurmctld")

    def _config(self, ports: list[int]) -> str:
        cores = len(os.sched_getaffinity(0))
        nodes = [
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cores} "
            f"CoresPerSocket={cores} ThreadsPerCore=1 RealMemory=1000"
            for name, port in zip(NODES, ports[1:], strict=True)
        ]
        return "\n".join(
            [
                "ClusterName=tests",
                "SlurmctldHost=localhost(127.0.0.1)",
                f"SlurmctldPort={ports[0]}",
                "SlurmUser=root",
                "SlurmdUser=root",
                "AuthType=auth/munge",
                "CredType=cred/munge",
                f"AuthInfo=socket={self.socket},cred_expire={REQUEUE_DELAY}",
                "SchedulerParameters=sched_interval=1,bf_interval=1",
                f"MinJobAge={MIN_JOB_AGE}",
                f"StateSaveLocation={self.root / 'state'}",
                f"SlurmdSpoolDir={self.root / 'spool-%n'}",
                f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
                f"SlurmdPidFile={self.root / 'slurmd-%n.pid'}",
                f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
                f"SlurmdLogFile={self.root / 'slurmd-%n.log'}",
                "MailProg=/bin/true",
                "ProctrackType=proctrack/linuxproc",
                "TaskPlugin=task/affinity",
                "SelectType=select/cons_tres",
                "SelectTypeParameters=CR_Core",
                "JobAcctGatherType=jobacct_gather/none",
                "AccountingStorageType=accounting_storage/none",
                "MpiDefault=none",
                "ReturnToService=2",
                *nodes,
                f"PartitionName=tests Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP",
                "",
            ]
        )

    def _daemon(self, name: str, command: list[str]) -> None:
        with open(self.root / f"{name}.out", "w") as log:
            self.daemons[name] = subprocess.Popen(
                command, cwd=self.root, env=self.env, stdout=log, stderr=subprocess.STDOUT
            )

    def _nodes_idle(self) -> bool:
        done = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env, capture_output=True, text=True)
        return sorted(done.stdout.split("\n")[:-1]) == sorted(f"{node} idle" for node in NODES)

    def _queued(self) -> bool:
        done = subprocess.run(["squeue", "-h", "-o", "%i"], env=self.env, capture_output=True, text=True)
        return done.returncode == 0 and bool(done.stdout.strip())

    def _wait(self, ready, what: str, log: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, daemon in self.daemons.items() if daemon.poll() is not None]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout} s"
                logs = "\n".join(f"{name}'s output:\n{self.log(name)}" for name in dead or [log])
                raise AssertionError(f"waiting for {what}: {why}.\n{logs}")
            time.sleep(0.2)

    def log(self, name: str) -> str:
        """The last lines of a daemon's output and of its log file (``slurmctld``, ``slurmd-node1``, ``munged``)."""
        paths = [self.root / f"{name}.out", self.root / f"{name}.log"]
        return "\n".join(
            line for path in paths if path.exists() for line in path.read_text(errors="replace").splitlines()[-40:]
        )

    def run(self, *command: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
        done = subprocess.run(command, cwd=cwd, env={**self.env, **(env or {})}, capture_output=True, text=True)
        assert done.returncode == 0, f"{' '.join(command)}: {done.stdout}{done.stderr}"
        return done.stdout

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` gives them (JobState, ExitCode, Restarts, Reason, ...)."""
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "-o", "show", "job", job_id)))

    def wait_for_job(self, job_id: str, done, what: str, timeout: float = 600) -> dict[str, str]:
        """Poll the job until ``done(fields)``; fail with its fields and slurmd's log after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not done(fields := self.job(job_id)):
            if time.monotonic() > deadline:
                log = self.log(f"slurmd-{NODES[0]}")
                raise AssertionError(f"job {job_id} not {what} within {timeout} s: {fields}\nslurmd's log:\n{log}")
            time.sleep(0.5)
        return fields

    def stop(self) -> None:
        # A job a failed test left running would outlive the daemons.
        subprocess.run(["scancel", "--user", pwd.getpwuid(os.geteuid()).pw_name], env=self.env, capture_output=True)
        deadline = time.monotonic() + 60
        while self._queued() and time.monotonic() < deadline:
            time.sleep(0.5)
        subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True)
        for name, daemon in reversed(self.daemons.items()):
            if name == "munged":
                daemon.terminate()
            try:
                daemon.wait(timeout=30)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        shutil.rmtree(self.root, ignore_errors=True)
