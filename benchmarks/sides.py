"""Running one side of the benchmark (the template, Lightning alone, the raw loop) once: each run in a session of
its own, stopped with every process it started after --side-timeout seconds, and named when it fails or hangs.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.workloads import REPO, WORKLOADS


class SideFailed(Exception):
    """A run of one side that failed or did not finish: its paragraph, and the end of its output."""

    def __init__(self, paragraph: str, output: str):
        super().__init__(paragraph)
        self.output = output


def run(command: list[str], cwd: Path, bound: float) -> None:
    """Run ``command`` in ``cwd`` (named after the run) for at most ``bound`` seconds, or raise SideFailed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)  # every side sets its threads itself, the same way
    cwd.mkdir(exist_ok=True)
    log = cwd / "output.log"  # a file, not a pipe: a process left holding a pipe would keep the benchmark waiting
    # How the side is started, as a user would type it: python cli.py, python -m benchmarks.raw_ddp.
    shown = command[: 3 if command[1] == "-m" else 2]
    side = " ".join("python" if word == sys.executable else Path(word).name for word in shown)
    with log.open("w") as output:
        # A session of its own, so that stopping it stops every process it started (the ranks) too.
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=output, start_new_session=True)
    try:
        status = process.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        why = f"did not finish within {bound:g} s (--side-timeout) and was stopped, with every process it started"
        raise SideFailed(f"{side} (run {cwd.name}) {why}. Its output is above.", log.read_text()) from None
    if status != 0:
        why = f"failed with exit status {status}"
        raise SideFailed(f"{side} (run {cwd.name}) {why}. Its output is above.", log.read_text())


def template_command(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, record: Path, *extra: str
) -> list[str]:
    """``python cli.py fit`` for ``steps`` steps on ``processes`` processes, its step times written to ``record``."""
    return [
        sys.executable,
        str(REPO / "cli.py"),
        "fit",
        *WORKLOADS[workload].arguments(quick, work / "cache", accelerator),
        f"--trainer.devices={processes}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        *extra,
        "--trainer.callbacks+=benchmarks.timing.StepTimer",
        f"--trainer.callbacks.out={record}",
    ]


def template_run(
    workload: str,
    processes: int,
    steps: int,
    quick: bool,
    accelerator: str,
    work: Path,
    name: str,
    *extra: str,
    bound: float,
) -> Path:
    """Train with ``python cli.py fit``; the record also holds when the command was launched."""
    record = work / f"{name}.json"
    launched = time.time()
    command = template_command(workload, processes, steps, quick, accelerator, work, record, *extra)
    run(command, cwd=work / name, bound=bound)
    record.write_text(json.dumps({**json.loads(record.read_text()), "launched": launched}))
    return record


def quiet_run(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, name: str, *, bound: float
) -> Path:
    """The template without its logger and progress bar, as plain Lightning runs (benchmarks/lightning_only.py)."""
    # Without any bar: with the template's turned off, Lightning would put its own in its place.
    no_logging = ("--trainer.logger=false", "--turn_off=[ProgressBar]", "--trainer.enable_progress_bar=false")
    return template_run(workload, processes, steps, quick, accelerator, work, name, *no_logging, bound=bound)


def untimed_run(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, name: str, *, bound: float
) -> Path:
    """The template without training.StepTime."""
    return template_run(
        workload, processes, steps, quick, accelerator, work, name, "--turn_off=[StepTime]", bound=bound
    )


def module_command(
    module: str,
    workload: str,
    processes: int,
    steps: int,
    quick: bool,
    accelerator: str,
    work: Path,
    record: Path,
    *extra: str,
) -> list[str]:
    """``python -m benchmarks.raw_ddp`` or ``benchmarks.lightning_only``: they take the same arguments. ``run`` puts
    the repo on PYTHONPATH, so the module is found from the run's own directory."""
    command = [
        sys.executable,
        "-m",
        module,
        "--workload",
        workload,
        "--processes",
        str(processes),
        "--accelerator",
        accelerator,
        "--steps",
        str(steps),
        "--out",
        str(record),
        "--data-dir",
        str(work / "cache"),
        *extra,
    ]
    return [*command, "--quick"] if quick else command


def module_run(
    module: str,
    workload: str,
    processes: int,
    steps: int,
    quick: bool,
    accelerator: str,
    work: Path,
    name: str,
    *extra: str,
    bound: float,
) -> Path:
    record = work / f"{name}.json"
    command = module_command(module, workload, processes, steps, quick, accelerator, work, record, *extra)
    run(command, cwd=work / name, bound=bound)
    return record
