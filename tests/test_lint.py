"""Static checks that CI runs with the tests."""

import subprocess
import sys

from tests.conftest import REPO


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_formatted():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(REPO)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
