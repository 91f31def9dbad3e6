#!/usr/bin/env python3
"""Run the project in the environments users have (Python, torch, Lightning) and print a Markdown table for the docs.

    python3 .ci/version_matrix.py                   # every row: about 11 GB of wheels the first time, minutes a row
    python3 .ci/version_matrix.py --only oldest     # CI's row: PyPI's small wheels and the CPU torch pip finds here
    python3 .ci/version_matrix.py --download-only   # fetch every row's wheels, run nothing

A row's environment (.ci/matrix_env.py) is requirements-dev.txt, the lock the tests run with, with the row's torch
and Lightning, made once. In it, from the repository's root: the fast tier (pytest -m "not distributed"), then the
main command twice, one epoch and a resume that must find the run complete, its logs in a temporary directory. Each
command's output is kept in --cache/logs/<row>/. Exit status 1 when any row fails.
Standard library only: it runs before any environment exists.
"""

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from matrix_env import REPO, Row, RowFailed, failure, run_logged, say, set_up

CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-ddp-template" / "matrix"
RUN_ID = "version-matrix"


ROWS = (
    Row("3.11", "2.8.0", "2.5.6"),
    Row("3.11", "2.8.0", "2.6.6"),
    Row("3.11", "2.13.0", "2.6.6"),  # the lock's pair
    Row("3.11", "2.13.0", "2.5.2"),  # "oldest": the lock's torch, which a CPU-only machine can have without CUDA wheels
    Row("3.12", "2.11.0", "2.6.6"),
    Row("3.12", "2.11.0", "2.5.6"),
    Row("3.13", "2.15.0", "2.6.6"),
    Row("3.13", "2.15.0", "2.5.6"),
)
ALIASES = {"oldest": "py3.11-torch2.13-lightning2.5.2"}


@dataclass
class Result:
    row: Row
    versions: tuple[str, ...] = ()  # Python, torch, Lightning, as the environment reports them
    fast_tier: str = "not run"
    main_command: str = "not run"
    failed: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def report_versions(row: Row, python: str, env: dict[str, str], result: Result) -> None:
    """The versions the environment has, for the table; what importing them prints is a note."""
    # A CUDA build of torch usually names its build in its version (2.11.0+cu130); the cell adds it where not.
    probe = (
        "import json, platform, torch, lightning; build = torch.version.cuda and '+' not in torch.__version__; "
        "print(json.dumps([platform.python_version(), torch.__version__ + (f' (CUDA {torch.version.cuda})' if build "
        "else ''), lightning.__version__]))"
    )
    done = subprocess.run([python, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RowFailed(f"import torch, lightning failed: {failure(done.stderr)}")
    result.versions = tuple(json.loads(done.stdout.splitlines()[-1]))
    say(row, "Python {}, torch {}, Lightning {}".format(*result.versions))
    if done.stderr.strip():
        result.notes.append(f"importing torch and Lightning prints: {done.stderr.strip().splitlines()[0]}")


def run_fast_tier(row: Row, python: str, env: dict[str, str], logs: Path, result: Result) -> None:
    """pytest's counts and wall time in the table, the first failed tests in the notes."""
    say(row, "fast tier")
    took = time.monotonic()
    command = [python, "-m", "pytest", "-m", "not distributed", "-q", "-p", "no:cacheprovider"]
    code, output = run_logged(command, logs / "fast-tier.log", env, timeout=3600)
    lines = output.splitlines()
    counts = [re.findall(r"(\d+ (?:passed|failed|skipped|errors?|xfailed|xpassed))\b", line) for line in lines]
    summary = next((", ".join(found) for found in reversed(counts) if found), "") or failure(output)
    result.fast_tier = f"{summary} ({duration(time.monotonic() - took)})"
    result.failed |= code != 0
    failed = list(dict.fromkeys(line for line in lines if line.startswith(("FAILED ", "ERROR "))))
    result.notes += failed[:3] + [f"and {len(failed) - 3} more: {logs / 'fast-tier.log'}"] * (len(failed) > 3)
    say(row, f"fast tier: {result.fast_tier}")


def run_main_command(row: Row, python: str, env: dict[str, str], logs: Path) -> str:
    """README's command for one epoch, then again, which must find the run complete: "works", or what failed."""
    with tempfile.TemporaryDirectory(prefix="version-matrix-") as save_dir:
        logger = f"--trainer.logger.init_args.save_dir={save_dir}"
        command = [python, "cli.py", "fit", "-c", "configs/ddp.yaml", "--trainer.max_epochs=1", logger]
        for step in ("fit", "resume"):
            say(row, f"main command ({step})")
            took = time.monotonic()
            code, output = run_logged(command, logs / f"{step}.log", {**env, "RUN_ID": RUN_ID}, timeout=1200)
            say(row, f"main command ({step}): exit {code} in {duration(time.monotonic() - took)}")
            if code != 0:
                return f"{step}: {'timed out' if code == -1 else failure(output)}"
            if step == "fit" and not list(Path(save_dir).glob(f"*/{RUN_ID}/checkpoints/last.ckpt")):
                return "fit: exit 0 without a last.ckpt"
            if step == "resume" and "Nothing to train" not in output:
                return "resume: exit 0 without finding the run complete (no 'Nothing to train')"
            if "nanobind: leaked" in output:  # an extension's words at exit that nothing in the run can act on
                return f"{step}: exit 0, then nanobind's list of leaked objects"
    return "works"


def run_row(row: Row, cache: Path, download_only: bool, fast_tier: bool) -> Result:
    result, started, logs = Result(row), time.monotonic(), cache / "logs" / row.name
    logs.mkdir(parents=True, exist_ok=True)
    try:
        python, notes = set_up(row, cache, logs, download_only)
        result.notes += notes
        if download_only:
            return result
        # As `. venv/bin/activate` would: the `python` the tests start is this one. The bytecode of the row's Python
        # goes into its environment, not into the repository's __pycache__.
        venv = Path(python).parent.parent
        env = {key: value for key, value in os.environ.items() if key not in ("PYTHONHOME", "PYTHONPATH")}
        env |= {"VIRTUAL_ENV": str(venv), "PATH": f"{venv}/bin:{env['PATH']}", "PYTHONPYCACHEPREFIX": f"{venv}/pycache"}
        report_versions(row, python, env, result)
        if fast_tier:
            run_fast_tier(row, python, env, logs, result)
        result.main_command = run_main_command(row, python, env, logs)
        result.failed |= result.main_command != "works"
    except RowFailed as error:
        result.main_command, result.failed = str(error), True
        say(row, str(error))
    finally:
        result.seconds = time.monotonic() - started
    return result


def table(results: list[Result], argv: list[str]) -> str:
    lines = ["| Python | torch | Lightning | fast tier | main command | time |", "|---|---|---|---|---|---|"]
    for r in results:
        versions = r.versions or (r.row.python, r.row.torch, r.row.lightning)  # the row's own where none was read
        cells = [*versions, r.fast_tier, r.main_command, duration(r.seconds)]
        lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    command = shlex.join(["python3", ".ci/version_matrix.py", *argv])
    lines += [
        "",
        f"{datetime.date.today()}, {platform.machine()} with {os.cpu_count()} cores, `{command}`. "
        "time: the whole row, its environment's setup included.",
        *(f"- {r.row.name}: {note}" for r in results for note in r.notes),
    ]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = [row.name for row in ROWS]
    parser.add_argument("--only", metavar="NAME[,NAME]", help=f"rows to run: {', '.join(names + list(ALIASES))}")
    parser.add_argument("--cache", type=Path, default=CACHE, help=f"wheels, environments and logs (default {CACHE})")
    parser.add_argument("--download-only", action="store_true", help="download each row's wheels; run nothing")
    parser.add_argument("--skip-fast-tier", action="store_true", help="run the main command only")
    args = parser.parse_args(argv)
    wanted = [ALIASES.get(name, name) for name in args.only.split(",")] if args.only else names
    if unknown := sorted(set(wanted) - set(names)):
        parser.error(f"no row named {', '.join(unknown)}; the rows: {', '.join(names + list(ALIASES))}")
    cache = args.cache.expanduser().resolve()
    results = [run_row(row, cache, args.download_only, not args.skip_fast_tier) for row in ROWS if row.name in wanted]
    if not args.download_only:
        print("\n" + table(results, argv))
    return 1 if any(result.failed for result in results) else 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except KeyboardInterrupt:  # run_logged has ended the command's process group
        sys.exit(130)
