"""A test past its time limit (pytest-timeout, ``timeout`` in pyproject.toml) ends with the Python stacks of the
processes it started, not only of pytest's own threads: a hang is most often in a job's rank, not in the test.

pytest-timeout's thread method prints the test's captured output and the stacks of this process, then ends it.
Before that, this reads the stack of every Python process under this one with ``py-spy dump`` (py-spy is in
requirements-dev.txt; it needs the right to trace them, which root has, and others where
``kernel.yama.ptrace_scope`` is 0) and stops them, so that no hung rank outlives the test run.
Loaded by ``-p tests.timeout_stacks`` in pyproject.toml's addopts.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest


def descendants(root: int) -> list[int]:
    """The processes under ``root``, parents before their children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # The command name, in parentheses, may hold spaces: the parent's pid is the second field after it.
            parent = int(stat.read_text().rpartition(")")[2].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, queue = [], [root]
    while queue:
        for child in sorted(children.get(queue.pop(0), [])):
            found.append(child)
            queue.append(child)
    return found


def command_line(pid: int) -> str:
    with contextlib.suppress(OSError):
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    return "?"


def is_python(pid: int) -> bool:
    with contextlib.suppress(OSError):
        return Path(os.readlink(f"/proc/{pid}/exe")).name.startswith("python")
    return False


def stacks_of_children() -> str:
    """The Python stacks of every Python process under this one, each headed by its pid and command line."""
    py_spy = shutil.which("py-spy", path=os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]))
    parts = []
    for pid in filter(is_python, descendants(os.getpid())):
        if py_spy is None:
            stack = "py-spy is not installed (pip install -r requirements-dev.txt): no stack"
        else:
            dumped = subprocess.run([py_spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=60)
            stack = dumped.stdout if dumped.returncode == 0 else f"py-spy could not read it: {dumped.stderr.strip()}"
        parts.append(f"---- Python stacks of process {pid}: {command_line(pid)}\n{stack.rstrip()}\n")
    return "\n".join(parts)


def stop_children_when_this_process_ends() -> None:
    """Kill the processes under this one once pytest-timeout has reported and ended this process: killed before, they
    would let the test go on, and the report would show it past the place where it hung."""
    pids = " ".join(map(str, reversed(descendants(os.getpid()))))
    if pids:
        # The pipe's end stays here: it closes when this process exits, and cat returns.
        killer = subprocess.Popen(["sh", "-c", f"cat >/dev/null; kill -9 {pids} 2>/dev/null"], stdin=subprocess.PIPE)
        os.set_inheritable(killer.stdin.fileno(), False)


@pytest.hookimpl(optionalhook=True)
def pytest_timeout_set_timer(item, settings):
    """pytest-timeout's thread method, preceded by the stacks of the test's processes."""
    if settings.method != "thread":
        return None
    import pytest_timeout

    def expire() -> None:
        try:
            # Shown under "Captured stderr" in the timeout's report.
            sys.stderr.write(f"\n{item.nodeid} ran past its {settings.timeout:g} s limit\n{stacks_of_children()}")
            stop_children_when_this_process_ends()
        finally:
            pytest_timeout.timeout_timer(item, settings)  # prints the report and this process's stacks, then exits

    timer = threading.Timer(settings.timeout, expire)
    timer.name = f"timeout {item.nodeid}"

    def cancel() -> None:
        timer.cancel()
        timer.join()

    item.cancel_timeout = cancel  # what pytest-timeout's own pytest_timeout_cancel_timer calls
    timer.start()
    return True
