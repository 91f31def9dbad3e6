#!/usr/bin/env python3
"""Run the project in the environments users have (Python, torch, Lightning) and print a Markdown table for the docs.

    python3 .ci/version_matrix.py                   # every row: about 11 GB of wheels the first time, minutes a row
    python3 .ci/version_matrix.py --only oldest     # CI's row: PyPI's small wheels and the CPU torch pip finds here
    python3 .ci/version_matrix.py --download-only   # fetch every row's wheels, run nothing

A row's environment is requirements-dev.txt, the lock the tests run with, with the row's torch and Lightning: a
virtual environment in --cache/<row>, made once and reused while those requirements stay the same. In it, from the
repository's root: the fast tier (pytest -m "not distributed"), then the main command twice, one epoch and a resume
that must find the run complete, its logs in a temporary directory. Wheels are downloaded once, into --cache/wheels,
by the row's own Python. Each command's output is kept in --cache/logs/<row>/. Exit status 1 when any row fails.
Standard library only: it runs before any environment exists.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "lightning-ddp-template" / "matrix"
RUN_ID = "version-matrix"
START = time.monotonic()


@dataclass(frozen=True)
class Row:
    python: str
    torch: str
    lightning: str

    @property
    def name(self) -> str:
        return f"py{self.python}-torch{'.'.join(self.torch.split('.')[:2])}-lightning{self.lightning}"


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


class RowFailed(Exception):
    """A step after which the row has nothing to run; the message goes in the table."""


@dataclass
class Result:
    row: Row
    versions: tuple[str, ...] = ()  # Python, torch, Lightning, as the environment reports them
    fast_tier: str = "not run"
    main_command: str = "not run"
    failed: bool = False
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0


def say(row: Row, message: str) -> None:
    elapsed = int(time.monotonic() - START)
    print(f"[{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}] {row.name}: {message}", flush=True)


def duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes} min {seconds} s" if minutes else f"{seconds} s"


def package(requirement: str) -> str:
    return re.match(r"[A-Za-z0-9._-]+", requirement)[0].lower().replace("_", "-")


def read_lock(path: Path) -> list[str]:
    """The requirements of ``path`` and of the files it includes with -r."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            lines += read_lock(path.parent / line[3:].strip())
        elif line:
            lines.append(line)
    return lines


def requirements(row: Row) -> list[str]:
    pins = {"torch": f"torch=={row.torch}", "lightning": f"lightning=={row.lightning}"}
    lock = read_lock(REPO / "requirements-dev.txt")
    if not pins.keys() <= {package(line) for line in lock}:
        sys.exit("error: requirements-dev.txt (with the files it includes) pins no torch or no lightning to replace")
    return [pins.get(package(line), line) for line in lock]


def find_python(version: str) -> str:
    """An interpreter of ``version``: pythonX.Y on PATH (a pyenv shim refuses a version pyenv has not selected),
    else pyenv's newest X.Y.Z."""
    found = [p for p in (Path.home() / ".pyenv/versions").glob(f"{version}.*") if re.fullmatch(r"[\d.]+", p.name)]
    found.sort(key=lambda p: int(p.name.split(".")[2]), reverse=True)
    probe = "import sys; print(sys.executable, '%d.%d' % sys.version_info[:2])"
    for candidate in [shutil.which(f"python{version}"), *(str(p / "bin/python3") for p in found)]:
        done = candidate and subprocess.run([candidate, "-c", probe], capture_output=True, text=True)
        if done and done.returncode == 0 and done.stdout.split()[-1] == version:
            return done.stdout.split()[0]
    raise RowFailed(f"no Python {version} (python{version} on PATH, or ~/.pyenv/versions/{version}.*)")


def run_logged(command: list[str], log: Path, env: dict[str, str], timeout: float | None = None) -> tuple[int, str]:
    """Run ``command`` from the repository's root, its output into ``log``: its exit status (-1 when it timed out)
    and output. It runs in a process group of its own, ended with it, so that no DDP rank or pytest worker outlives
    it, after a timeout or a Ctrl-C either."""
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=out, start_new_session=True)
        try:
            code = process.wait(timeout)
        except subprocess.TimeoutExpired:
            code = -1
        finally:
            for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, None)):  # SIGTERM first: a rank saves and ends
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(grace)
    return code, log.read_text(errors="replace")


def failure(output: str) -> str:
    """What a failed command said: the first sentence of the project's refusal (a paragraph starting "error: "),
    else the first exception of a traceback, else pip's first error short of its list of versions, else the last
    line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if refusal := next((line for line in lines if line.startswith("error: ")), None):
        return re.match(r".+?(?<!e\.g)(?<!i\.e)[.!?](?=\s|$)|.+", refusal)[0]
    exception = re.compile(r"[\w.]*(Error|Exception|Interrupt)(: |$)")
    pip = (line for line in lines if line.startswith("ERROR: ") and "(from versions:" not in line)
    return next((line for line in lines if exception.match(line)), next(pip, lines[-1] if lines else "no output"))


def download_wheels(row: Row, python: str, venv: Path, cache: Path, logs: Path) -> tuple[list[str], dict, list[str]]:
    """Download the row's wheels with its Python into --cache/wheels, pip's answer deciding what no rule can: a
    torch above this machine's cap on it, a pin without a wheel for this Python. The pins it dropped, the environment
    pip needs, and notes; venv/requirements.txt says what to install."""
    pinned, unpinned, pip_env, notes, again = requirements(row), [], {}, [], ""
    while True:
        (venv / "requirements.txt").write_text("\n".join(pinned) + "\n")
        say(row, f"downloading wheels{again}")
        # --no-cache-dir: pip's own cache would keep a second copy of each wheel, GBs for each CUDA torch.
        download = ["download", "--no-cache-dir", "--only-binary=:all:", "-d", str(cache / "wheels")]
        command = [python, "-m", "pip", *download, "-r", str(venv / "requirements.txt")]
        code, output = run_logged(command, logs / "pip-download.log", {**os.environ, **pip_env})
        if code == 0:
            return unpinned, pip_env, notes
        missing = re.search(r"No matching distribution found for ([\w.-]+)(\[[^]]*\])?==", output)  # [extras]
        found = [line for line in pinned if missing and "==" in line and package(line) == package(missing[1])]
        cap = re.search(r"The user requested \(constraint\) torch<=?([\d.]+)", output)
        if not pip_env and cap and [int(n) for n in row.torch.split(".")] > [int(n) for n in cap[1].split(".")]:
            # This machine's pip config caps torch (its CPU build is on disk): a newer torch comes from PyPI without it.
            pip_env, again = {"PIP_CONFIG_FILE": os.devnull}, " again, without this machine's pip config"
            notes.append(f"torch {row.torch} is above this machine's pip cap: installed with PIP_CONFIG_FILE=/dev/null")
        elif found and package(found[0]) not in ("torch", "lightning"):
            pinned, unpinned = [line.split("==")[0] if line == found[0] else line for line in pinned], unpinned + found
            again = f" again, {package(found[0])} unpinned: {found[0]} has no wheel for Python {row.python}"
        else:
            raise RowFailed(f"pip download failed: {failure(output)}")


def set_up(row: Row, cache: Path, logs: Path, download_only: bool) -> tuple[str, list[str]]:
    """The row's environment, made or reused: its Python, and notes on where it differs from the lock."""
    venv, wanted = cache / row.name, requirements(row)
    python, made = str(venv / "bin/python"), venv / "matrix-row.json"  # made: written once the install is complete
    if made.exists() and (record := json.loads(made.read_text()))["requirements"] == wanted:
        say(row, f"reusing {venv}")
        return python, record["notes"]
    shutil.rmtree(venv, ignore_errors=True)
    base = find_python(row.python)
    say(row, f"making {venv} with {base}")
    done = subprocess.run([base, "-m", "venv", str(venv)], capture_output=True, text=True)
    if done.returncode != 0:
        raise RowFailed(f"{base} -m venv failed: {failure(done.stderr + done.stdout)}")
    unpinned, pip_env, notes = download_wheels(row, python, venv, cache, logs)
    if download_only:
        return python, notes
    say(row, "installing")
    install = ["install", "--no-index", "--find-links", str(cache / "wheels"), "-r", str(venv / "requirements.txt")]
    code, output = run_logged([python, "-m", "pip", *install], logs / "pip-install.log", {**os.environ, **pip_env})
    if code != 0:
        raise RowFailed(f"pip install failed: {failure(output)}")
    for line in unpinned:
        probe = f"import importlib.metadata as m; print(m.version({package(line)!r}))"
        chose = subprocess.run([python, "-c", probe], capture_output=True, text=True).stdout.strip()
        notes.append(f"{line} has no wheel for Python {row.python}: pip chose {package(line)} {chose}")
    made.write_text(json.dumps({"requirements": wanted, "notes": notes}))
    return python, notes


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
