"""The whole GPU check in one command, for a GPU machine without internet: the GPU tier of the tests, the main
command and the GPU benchmark's short mode (5 rounds in about 5 minutes on one H100), then a summary to paste into a
note.

    python -m scripts.gpu_tier WHEELS_DIR              # WHEELS_DIR: wheels of what the machine lacks (DEVELOPERS.md)
    python -m scripts.gpu_tier WHEELS_DIR --dry-run    # what it would install and run; needs no GPU

torch, Lightning and the rest that the machine has are used as installed (a GPU image's torch is its CUDA build);
every wheel in WHEELS_DIR of a project this Python lacks goes into a throwaway directory with pip --no-index
--no-deps, which the steps get on their PYTHONPATH. Each step's whole output goes to --out (default:
/tmp/gpu-tier-<time>). Exit status 0 when every step passed, 1 when one failed, 2 when it could not start.
"""

import argparse
import importlib.metadata
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
# What the GPU tier imports: the template's pins, matplotlib for the charts, and pytest with the plugins that
# pyproject.toml's options name.
PIN_FILES = ("requirements.txt", "requirements-charts.txt")
TEST_PINS = ("pytest", "pytest-xdist", "pytest-timeout")
COUNTS = ("passed", "failed", "errors", "skipped")


def normalized(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def installed_version(project: str) -> str | None:
    try:
        return importlib.metadata.version(project)
    except importlib.metadata.PackageNotFoundError:
        return None


def pins() -> dict[str, str]:
    """Project -> pinned version, of every pin the GPU tier needs."""
    found = {}
    lines = [line for name in PIN_FILES for line in (REPO / name).read_text().splitlines()]
    dev = (REPO / "requirements-dev.txt").read_text().splitlines()
    lines += [line for line in dev if normalized(line.split("==")[0]) in TEST_PINS]
    for line in lines:
        if match := re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^\s#;]+)", line):
            found[normalized(match[1])] = match[3]
    return found


def wheels_to_install(wheels: Path) -> list[Path]:
    """The wheels in ``wheels`` of projects this Python does not have."""
    return sorted(wheel for wheel in wheels.glob("*.whl") if installed_version(wheel.name.split("-")[0]) is None)


def missing_pins(wheels: list[Path]) -> list[str]:
    """The pins neither this Python nor ``wheels`` provides."""
    carried = {normalized(wheel.name.split("-")[0]) for wheel in wheels}
    return [f"{p}=={v}" for p, v in pins().items() if installed_version(p) is None and p not in carried]


def refuse(why: str) -> None:
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def steps(out: Path, gpus: int) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Each step's command, run from the project directory, and what it adds to the environment. The main command
    trains a run of its own (logs/toy/gpu-tier-<time>) on every GPU, its node log in ``out``."""
    python = sys.executable
    run = {"RUN_ID": f"gpu-tier-{int(time.time())}", "MASTER_PORT": str(free_port()), "LOG_DIR": str(out / "nodes")}
    bench = [python, "-m", "benchmarks.bench", "--short", "--accelerator", "gpu", "--out", str(out / "bench")]
    return {
        "GPU tier": ([python, "-m", "pytest", "-m", "gpu", "-n", "0", "-rA", "-p", "no:cacheprovider"], {}),
        "main command": (["./scripts/run_ddp_train.sh", ",".join(map(str, range(gpus))), "0"], run),
        "benchmark": (bench, {}),
    }


def run_step(name: str, command: list[str], env: dict[str, str], out: Path) -> tuple[int, str, float]:
    """Run ``command``, its output shown and written to ``out``; its status, output and seconds."""
    print(f"==== {name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    log = out / f"{name.replace(' ', '_')}.log"
    with (
        log.open("w") as file,
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
        for line in process.stdout:
            print(line, end="", flush=True)
            file.write(line)
    return process.returncode, log.read_text(), time.monotonic() - started


def test_counts(output: str) -> str:
    """The counts of pytest's last line (``4 failed, 10 passed, 2 skipped in 222.31s``), in a fixed order."""
    counted = r"(\d+) (passed|failed|skipped|errors?)\b"
    last = [line for line in output.splitlines() if re.search(rf"{counted}.* in [\d.]+s", line)][-1:]
    found = {{"error": "errors"}.get(word, word): int(n) for n, word in re.findall(counted, "".join(last))}
    return ", ".join(f"{found.get(word, 0)} {word}" for word in COUNTS)


def bench_headlines(output: str) -> list[str]:
    """What the summary keeps of the benchmark: the ratios its goals are judged by (the template over Lightning
    with its spread, and the step-time measurement's cost, on every row), its headlines, and its time against its
    budget, a warning when over."""
    kept = (
        "  template/Lightning",
        "step-time measurement",
        "worst template/",
        "short mode: took",
        "warning: the short",
    )
    return [line.strip() for line in output.splitlines() if line.startswith(kept)]


def machine() -> list[str]:
    """The GPUs, driver and versions, read once the steps' packages are importable (the doctor needs them)."""
    import lightning

    from scripts.doctor import driver_version

    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
    return [
        f"GPUs: {len(names)} x {', '.join(sorted(set(names)))}; NVIDIA driver {driver_version()}",
        f"Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, NCCL {nccl}), "
        f"Lightning {lightning.__version__}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("wheels", type=Path, help="a folder of wheels of the pins this machine lacks")
    parser.add_argument("--dry-run", action="store_true", help="say what would be installed and run, and stop")
    parser.add_argument("--out", type=Path, help="where each step's output goes (default: /tmp/gpu-tier-<time>)")
    options = parser.parse_args()
    fill = "fill it as DEVELOPERS.md says (A GPU machine without internet), on a machine with internet"
    if not options.wheels.is_dir():
        refuse(f"the wheels folder {options.wheels} does not exist: {fill}, and copy it here.")
    wheels = wheels_to_install(options.wheels)
    if missing := missing_pins(wheels):
        refuse(
            f"this Python ({sys.executable}) lacks {', '.join(missing)}, and {options.wheels} has no wheel of "
            f"{'it' if len(missing) == 1 else 'them'}: {fill}, with these pins too."
        )
    out = options.out or Path(tempfile.gettempdir()) / f"gpu-tier-{int(time.time())}"
    target = out / "site"
    install = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--target", str(target)]
    install += [str(wheel) for wheel in wheels]
    if options.dry_run:
        print(f"would install: {' '.join(install) if wheels else 'nothing, every wheel is installed already'}")
        for name, (command, settings) in steps(out, 1).items():
            print(f"would run ({name}): {' '.join([*(f'{k}={v}' for k, v in settings.items()), *command])}")
        return 0
    if not torch.cuda.is_available():
        refuse(
            f"torch {torch.__version__} sees no CUDA GPU here (CUDA build: {torch.version.cuda or 'none'}), and "
            "this check is for a GPU machine. On CPU, run README's test command; here, --dry-run shows the steps."
        )
    out.mkdir(parents=True, exist_ok=True)
    if wheels and subprocess.run(install).returncode != 0:
        refuse(f"pip could not install the wheels of {options.wheels} (above); nothing was run.")
    sys.path.insert(0, str(target))
    path = os.pathsep.join(filter(None, [str(target), str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHON": sys.executable}
    results = {
        name: run_step(name, command, env | settings, out)
        for name, (command, settings) in steps(out, torch.cuda.device_count()).items()
    }

    status, output, seconds = results["GPU tier"]
    failed = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
    lines = [f"GPU tier: {test_counts(output)} ({seconds:.0f} s)", *(f"  {line}" for line in failed)]
    status, output, seconds = results["main command"]
    lines.append(f"main command: {'ok' if status == 0 else f'failed with status {status}'} ({seconds:.0f} s)")
    status, output, seconds = results["benchmark"]
    lines.append(f"benchmark: {'ok' if status == 0 else f'failed with status {status}'} ({seconds:.0f} s)")
    lines += [f"  {line}" for line in bench_headlines(output)]
    installed = ", ".join(wheel.name.split("-")[0] for wheel in wheels) or "nothing"
    lines += [*machine(), f"installed from {options.wheels}: {installed}; every step's output in {out}"]
    print("==== summary", *lines, sep="\n")
    return 0 if all(status == 0 for status, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
