"""Install what the template needs into this Python, keeping a torch it supports (a GPU image's CUDA build):

    python -m scripts.install              # requirements.txt, with this Python's torch kept where it is supported
    python -m scripts.install --dry-run    # what pip would install, without installing it

requirements.txt pins the exact versions the tests ran with. A torch already installed in the range pyproject.toml
declares stays as it is, with its CUDA build: pip installs the other pins with a constraint that holds torch at its
version. Without torch, or with one outside the range, pip installs the pinned torch: on Linux, PyPI's build for
CUDA 13.0 (NVIDIA driver 580 or newer); docs/versions.md says how to take a CUDA 12 build instead.
"""

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from training.job import versions

LOCK = versions.PROJECT / "requirements.txt"


def pip_arguments(torch: str | None, folder: Path) -> tuple[list[str], str]:
    """pip's install arguments for a Python whose torch is ``torch`` (None: none), with any files they need written
    into ``folder``, and the line that says what happens to its torch."""
    lock = LOCK.read_text().splitlines()
    pinned = next(line.split("==")[1] for line in lock if line.startswith("torch=="))
    torch_range = versions.supported()[1]["torch"]
    if torch is None:
        return ["-r", str(LOCK)], f"no torch in this Python: installing torch {pinned}, the one the tests ran with"
    if not versions.allows(torch_range, torch):
        told = f"torch {torch} is outside the range the template supports (torch{torch_range}): replacing it with"
        return ["-r", str(LOCK)], f"{told} {pinned}, the one the tests ran with"
    (folder / "requirements.txt").write_text("\n".join(line for line in lock if not line.startswith("torch==")))
    (folder / "constraints.txt").write_text(f"torch=={'.'.join(map(str, versions.release(torch)))}\n")
    told = f"keeping torch {torch} (in the supported range torch{torch_range}; the tests ran with {pinned})"
    return ["-r", str(folder / "requirements.txt"), "-c", str(folder / "constraints.txt")], told


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="pip's --dry-run: say what it would install")
    dry_run = parser.parse_args().dry_run
    if paragraph := versions.python_refusal():
        print(f"error: {paragraph}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as folder:
        arguments, told = pip_arguments(versions.installed("torch"), Path(folder))
        print(told, flush=True)
        command = [sys.executable, "-m", "pip", "install", *arguments, *(["--dry-run"] if dry_run else [])]
        return subprocess.run(command).returncode


if __name__ == "__main__":
    sys.exit(main())
