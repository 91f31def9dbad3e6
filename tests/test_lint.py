"""Static checks that CI runs with the tests."""

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_ruff_finds_nothing():
    result = subprocess.run([sys.executable, "-m", "ruff", "check", str(REPO)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_code_is_formatted():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", str(REPO)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


SHELL_SCRIPTS = sorted([*REPO.glob("scripts/*.sh"), *REPO.glob("scripts/*.sbatch"), REPO / ".ci" / "run"])


def test_shell_scripts_parse():
    for script in SHELL_SCRIPTS:
        result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert result.returncode == 0, f"{script}: {result.stderr}"


def test_shellcheck_finds_nothing():
    shellcheck = Path(sys.executable).with_name("shellcheck")
    result = subprocess.run(
        [str(shellcheck), "-x", "-P", "SCRIPTDIR", *map(str, SHELL_SCRIPTS)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
