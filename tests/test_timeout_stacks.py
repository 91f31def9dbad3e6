"""A test past its time limit ends with the Python stacks of the processes it started (tests/timeout_stacks.py)."""

import os
import select
import subprocess
import sys

from tests.helpers import REPO

# A test whose process hangs in a function of its own, started (and seen running) before the test's time starts.
HANGING_TEST = """
import subprocess, sys
from pathlib import Path

import pytest

CHILD = "import threading\\ndef hang_in_the_child():\\n    print('hanging', flush=True)\\n"
CHILD += "    threading.Event().wait()\\nhang_in_the_child()\\n"


@pytest.fixture
def child():
    process = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline() == "hanging\\n"
    Path("child.pid").write_text(str(process.pid))
    return process


def test_waits_for_a_hung_process(child):
    child.wait()
"""


def test_a_timed_out_test_shows_the_stacks_of_its_processes_and_stops_them(tmp_path):
    (tmp_path / "test_hang.py").write_text(HANGING_TEST)
    options = [
        "-p",
        "no:cacheprovider",
        "-p",
        "tests.timeout_stacks",
        "-o",
        "timeout_func_only=true",
        "-o",
        "timeout_method=thread",
    ]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-c", "/dev/null", "--rootdir", str(tmp_path), *options, "--timeout", "2"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))},
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    pid = (tmp_path / "child.pid").read_text()
    assert f"---- Python stacks of process {pid}: {sys.executable} -c import threading" in output, output
    child_stack = output.partition(f"---- Python stacks of process {pid}")[2]
    assert "hang_in_the_child (<string>:4)" in child_stack, output
    assert "test_hang.py::test_waits_for_a_hung_process ran past its 2 s limit" in output, output
    # pytest's own stack, where the test waits: the child was not stopped before the report.
    assert "in test_waits_for_a_hung_process\n    child.wait()" in output.rpartition("Timeout")[0], output
    # The hung process is stopped once pytest has ended.
    try:
        ended = os.pidfd_open(int(pid))
    except ProcessLookupError:
        return
    try:
        assert select.select([ended], [], [], 60)[0], "the hung process was left running"
    finally:
        os.close(ended)
