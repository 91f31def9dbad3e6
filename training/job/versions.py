"""The versions of Python, torch, Lightning, jsonargparse and omegaconf this node has, against the range the template
supports (pyproject.toml): checked first thing by cli.py, scripts/run_ddp_train.sh and scripts/doctor.sh.

    python -m training.job.versions     # exit 0, or 2 with the paragraph naming the package, the range and the fix

An older release stops the run before anything starts, in one paragraph, where it would fail later in a traceback or
a config error that blames the user's YAML; a release newer than the newest tested one runs, with one line saying so.
Standard library only, and no import of the packages themselves (seconds): it reads their installed metadata.
"""

from __future__ import annotations

import functools
import os
import re
import sys
from pathlib import Path

from training.job.early import own_local_rank

PROJECT = Path(__file__).resolve().parents[2]
CHECKED = ("torch", "lightning", "jsonargparse", "omegaconf")
INSTALL = "python -m scripts.install"


def release(version: str) -> tuple[int, ...]:
    """The release numbers of ``version``: 2.11.0+cu128 -> (2, 11, 0); a pre-release counts as its release."""
    return tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", version)[0].split("."))


def allows(specifier: str, version: str) -> bool:
    """Whether ``version`` is in ``specifier`` (">=2.8,!=2.6.2,<3"), compared by release numbers."""
    have = release(version)
    for clause in specifier.split(","):
        op, bound = re.fullmatch(r"\s*(>=|<=|==|!=|<|>)\s*([\d.]+)\s*", clause).groups()
        width = max(len(have), len(release(bound)))
        mine, theirs = (numbers + (0,) * (width - len(numbers)) for numbers in (have, release(bound)))
        if not {">=": mine >= theirs, "<=": mine <= theirs, "==": mine == theirs, "!=": mine != theirs,
                "<": mine < theirs, ">": mine > theirs}[op]:  # fmt: skip
            return False
    return True


@functools.cache  # the refusal and the notes ask for each package
def installed(name: str) -> str | None:
    """The version of distribution ``name`` that this Python imports, or None. Read from the name of its dist-info
    directory: importing importlib.metadata would cost most of this check's time, in every process of every run."""
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for found in names:
            if found.endswith(".dist-info") and found.lower().startswith(f"{name}-"):
                return found[len(name) + 1 : -len(".dist-info")]
    import importlib.metadata  # an install without a dist-info directory (a source build's egg-info)

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


@functools.cache
def supported() -> tuple[str, dict[str, str], dict[str, str], dict[str, str]]:
    """Python's range, then each checked package's range, the newest release of each that was tested, and why an
    older release cannot work: from pyproject.toml."""
    text = (PROJECT / "pyproject.toml").read_text()
    python = re.search(r'^requires-python\s*=\s*"([^"]+)"', text, re.MULTILINE)[1]
    if sys.version_info < (3, 11):  # noqa: UP036  # no tomllib: the check of Python refuses it before its use
        return python, {}, {}, {}
    import tomllib

    settings = tomllib.loads(text)
    ranges = {}
    for requirement in settings["project"]["dependencies"]:
        name, specifier = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^]]*\])?\s*(.*)", requirement).groups()
        if name in CHECKED:
            ranges[name] = specifier
    template = settings["tool"]["lightning-ddp-template"]
    return python, ranges, template["newest-tested"], template["oldest-because"]


def python_refusal() -> str | None:
    """The paragraph refusing this Python, or None when it is in the range."""
    python_range = supported()[0]
    python = ".".join(map(str, sys.version_info[:3]))
    if allows(python_range, python):
        return None
    return (
        f"Python {python} is outside the range the template supports (Python{python_range}: it uses Python 3.11's "
        "language and library; 3.10 reached its end of life in October 2026). Make the virtual environment with a "
        f"newer Python (python3.12 -m venv .venv) and run {INSTALL} in it. Nothing was started."
    )


def refusal() -> str | None:
    """The paragraph refusing this node's Python or a checked package, or None when each is in its range."""
    if paragraph := python_refusal():
        return paragraph
    _, ranges, _, because = supported()
    for name, specifier in ranges.items():
        version = installed(name)
        if version is None:
            problem = f"{name} is not installed in this Python ({sys.executable})"
        elif not allows(specifier, version):
            problem = f"{name} {version} is outside the range the template supports ({name}{specifier}: "
            problem += f"{because[name]})"
        else:
            continue
        return (
            f"{problem}. Install the versions the template is tested with: {INSTALL} (it keeps a torch in the range, "
            "and its CUDA build; docs/versions.md says how to choose another build), or pip install "
            f"'{name}{specifier}'. Nothing was started."
        )
    return None


def newer_than_tested() -> list[str]:
    """One line for each checked package (and Python) newer than the newest release tested with the template."""
    _, ranges, newest, _ = supported()
    have = {"python": ".".join(map(str, sys.version_info[:3]))} | {name: installed(name) or "" for name in ranges}
    return [
        f"note: {name} {version} is newer than the newest release this template was tested with ({newest[name]}, "
        "docs/versions.md): it should work; what does not is worth an issue."
        for name, version in have.items()
        if version and release(version)[: len(release(newest[name]))] > release(newest[name])
    ]


def known_bugs(python: tuple[int, ...] = sys.version_info[:3]) -> list[str]:
    """One line for each bug of this node's releases that training can meet, for the doctor (docs/versions.md)."""
    if python >= (3, 11, 10):
        return []
    return [
        f"note: Python {'.'.join(map(str, python))} can leave a process forked beside a thread, such as a DataLoader "
        "worker, stuck before its first line (CPython gh-112275, fixed in 3.11.10): the stall report names it as a "
        "worker that did not answer. docs/versions.md says what the template does about it."
    ]


def check(notes: bool = True) -> None:
    """Exit with status 2 and the refusal; else go on, with the ``notes`` of newer releases said by a node's first
    process."""
    if paragraph := refusal():
        print(f"error: {paragraph}", file=sys.stderr)
        sys.exit(2)
    if notes and own_local_rank() == 0:
        for line in newer_than_tested():
            print(line, file=sys.stderr)


if __name__ == "__main__":  # the launchers: cli.py, which they start, says the notes
    check(notes=False)
