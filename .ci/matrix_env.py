"""A row of .ci/version_matrix.py and its virtual environment: requirements-dev.txt, the lock the tests run with, with
the row's torch and Lightning, made once in --cache/<row> and reused while those requirements stay the same. Wheels
are downloaded once, into --cache/wheels, by the row's own Python. Standard library only."""

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
START = time.monotonic()


@dataclass(frozen=True)
class Row:
    python: str
    torch: str
    lightning: str

    @property
    def name(self) -> str:
        return f"py{self.python}-torch{'.'.join(self.torch.split('.')[:2])}-lightning{self.lightning}"


class RowFailed(Exception):
    """A step after which the row has nothing to run; the message goes in the table."""


def say(row: Row, message: str) -> None:
    elapsed = int(time.monotonic() - START)
    print(f"[{elapsed // 3600}:{elapsed // 60 % 60:02d}:{elapsed % 60:02d}] {row.name}: {message}", flush=True)


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


def download_wheels(row: Row, python: str, venv: Path, cache: Path, logs: Path) -> tuple[dict, list[str]]:
    """Download the row's wheels with its Python into --cache/wheels, pip's answer deciding what no rule can: a
    torch above this machine's cap on it. The environment pip needs, and notes; venv/requirements.txt says what to
    install."""
    pinned, pip_env, notes, again = requirements(row), {}, [], ""
    while True:
        (venv / "requirements.txt").write_text("\n".join(pinned) + "\n")
        say(row, f"downloading wheels{again}")
        # --no-cache-dir: pip's own cache would keep a second copy of each wheel, GBs for each CUDA torch.
        download = ["download", "--no-cache-dir", "--only-binary=:all:", "-d", str(cache / "wheels")]
        command = [python, "-m", "pip", *download, "-r", str(venv / "requirements.txt")]
        code, output = run_logged(command, logs / "pip-download.log", {**os.environ, **pip_env})
        if code == 0:
            return pip_env, notes
        cap = re.search(r"The user requested \(constraint\) torch<=?([\d.]+)", output)
        if not pip_env and cap and [int(n) for n in row.torch.split(".")] > [int(n) for n in cap[1].split(".")]:
            # This machine's pip config caps torch (its CPU build is on disk): a newer torch comes from PyPI without it.
            pip_env, again = {"PIP_CONFIG_FILE": os.devnull}, " again, without this machine's pip config"
            notes.append(f"torch {row.torch} is above this machine's pip cap: installed with PIP_CONFIG_FILE=/dev/null")
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
    pip_env, notes = download_wheels(row, python, venv, cache, logs)
    if download_only:
        return python, notes
    say(row, "installing")
    install = ["install", "--no-index", "--find-links", str(cache / "wheels"), "-r", str(venv / "requirements.txt")]
    code, output = run_logged([python, "-m", "pip", *install], logs / "pip-install.log", {**os.environ, **pip_env})
    if code != 0:
        raise RowFailed(f"pip install failed: {failure(output)}")
    made.write_text(json.dumps({"requirements": wanted, "notes": notes}))
    return python, notes
