import os
import subprocess
import sys
from pathlib import Path

import pytest

import cli

REPO = Path(__file__).resolve().parents[1]
DDP_YAML = str(REPO / "configs" / "ddp.yaml")
# In-process runs stay in this pytest process: one device, no process group.
SINGLE_PROCESS = ["--trainer.strategy=auto", "--trainer.devices=1", "--trainer.enable_progress_bar=false"]


@pytest.fixture
def run_cli(tmp_path, monkeypatch):
    """Run cli.main in-process, as ``python cli.py ARGS`` from ``tmp_path``."""
    monkeypatch.chdir(tmp_path)

    def run(*args: str) -> cli.CLI:
        monkeypatch.setattr(sys, "argv", ["cli.py", *args])
        return cli.main()

    return run


def run_script(args: list[str], cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    """Run a project entry point as a user would, with the repo importable and output captured."""
    full_env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run(
        [sys.executable, *args] if args[0].endswith(".py") else args,
        cwd=cwd,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
