"""The whole GPU check, for a GPU machine without internet, in one command or in parts: the GPU tier of the tests
in two halves (tier: training; tools: the doctor and the benchmarks), the main command (main) and the GPU benchmark's
short mode (bench), then a summary to paste into a note.

    python -m scripts.gpu_tier WHEELS_DIR               # every part; WHEELS_DIR: wheels of what the machine lacks
    python -m scripts.gpu_tier WHEELS_DIR --only tier   # the tier's training tests
    python -m scripts.gpu_tier WHEELS_DIR --only tools  # the doctor's and the benchmarks' GPU tests
    python -m scripts.gpu_tier WHEELS_DIR --only main   # the main command: 19 s on one H200
    python -m scripts.gpu_tier WHEELS_DIR --only bench  # 5 rounds in about 5 minutes on one H100
    python -m scripts.gpu_tier WHEELS_DIR --dry-run     # what it would install and run; needs no GPU

Where a command's time is limited (a lent GPU machine's), run the parts one command each, tier first: it checks what
the others rely on (training with NCCL) and names what fails, so a broken machine spends no 5 minutes on the
benchmark. --only repeats (--only tier --only main); the parts run in the order above. Every summary names the steps
it did not run, so the summaries of several calls pasted together are unambiguous. Each step's log in --out gives
every line the seconds since the step began, so a step cut off by a time limit still shows where its time went.

torch, Lightning and the rest that the machine has are used as installed (a GPU image's torch is its CUDA build);
every wheel in WHEELS_DIR of a project this Python lacks, less those pinned only for parts not run, is installed into
this Python with pip --no-index --no-deps (a project it has is never replaced): the tests and the benchmark start
processes of their own with the repo alone on PYTHONPATH, so a directory of wheels on it would not reach them, and
these are the packages the template needs in this Python anyway. Each step's whole output goes to --out (default:
/tmp/gpu-tier-<time>). Exit status 0 when every step run passed, 1 when one failed, 2 when it could not start.
"""

import argparse
import importlib
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
PARTS = {
    "tier": "GPU tier, training",
    "tools": "GPU tier, doctor and benchmarks",
    "main": "main command",
    "bench": "benchmark",
}
# The GPU tier's test files (every file with a test marked by tests.helpers.needs_gpus), in the two halves that each
# fit one command: the whole tier took over 8 minutes on one H200.
TIER_FILES = {
    "tier": ("test_gpu.py", "test_fsdp.py", "test_seq2seq_model.py", "test_rng.py", "test_step_time.py"),
    "tools": ("test_doctor.py", "test_bench.py", "test_gpu_defaults.py"),
}
# What each part imports: the template's pins; matplotlib for the tests' and the benchmark's charts, not for the
# main command, which runs as requirements.txt installs it (torchmetrics imports matplotlib in every rank where it
# is importable); and, for the tier, pytest with the plugins that pyproject.toml's options name (TEST_PINS, the only
# pins of requirements-dev.txt it needs).
PIN_FILES = {
    "tier": ("requirements.txt", "requirements-charts.txt", "requirements-dev.txt"),
    "tools": ("requirements.txt", "requirements-charts.txt", "requirements-dev.txt"),
    "main": ("requirements.txt",),
    "bench": ("requirements.txt", "requirements-charts.txt"),
}
TEST_PINS = ("pytest", "pytest-xdist", "pytest-timeout")
COUNTS = ("passed", "failed", "errors", "skipped")


def normalized(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def installed_version(project: str) -> str | None:
    try:
        return importlib.metadata.version(project)
    except importlib.metadata.PackageNotFoundError:
        return None


def pins(parts: list[str]) -> dict[str, str]:
    """Project -> pinned version, of every pin the steps of ``parts`` need."""
    found = {}
    for name in dict.fromkeys(file for part in parts for file in PIN_FILES[part]):
        for line in (REPO / name).read_text().splitlines():
            match = re.match(r"^([A-Za-z0-9_.-]+)(\[[^]]*\])?==([^\s#;]+)", line)
            if match and (name != "requirements-dev.txt" or normalized(match[1]) in TEST_PINS):
                found[normalized(match[1])] = match[3]
    return found


def wheels_to_install(wheels: Path, parts: list[str]) -> list[Path]:
    """The wheels in ``wheels`` of projects this Python does not have, less those pinned only for other parts. A wheel
    no pin names (jsonargparse's extras, a pin's dependency) goes in with every part: only its metadata says whose
    it is, and a spare wheel on the path costs nothing."""
    others = pins(list(PARTS)).keys() - pins(parts).keys()
    projects = {wheel: wheel.name.split("-")[0] for wheel in wheels.glob("*.whl")}
    return sorted(w for w, p in projects.items() if installed_version(p) is None and normalized(p) not in others)


def missing_pins(wheels: list[Path], parts: list[str]) -> list[str]:
    """The pins of ``parts`` that neither this Python nor ``wheels`` provides."""
    carried = {normalized(wheel.name.split("-")[0]) for wheel in wheels}
    return [f"{p}=={v}" for p, v in pins(parts).items() if installed_version(p) is None and p not in carried]


def refuse(why: str) -> None:
    print(f"error: {why}", file=sys.stderr)
    sys.exit(2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def steps(out: Path, gpus: int, parts: list[str]) -> dict[str, tuple[list[str], dict[str, str]]]:
    """Part -> its step's command, run from the project directory, and what it adds to the environment, of each of
    ``parts``. The main command trains a run of its own (logs/toy/gpu-tier-<time>) on every GPU, its node log in
    ``out``."""
    python = sys.executable
    run = {"RUN_ID": f"gpu-tier-{int(time.time())}", "MASTER_PORT": str(free_port()), "LOG_DIR": str(out / "nodes")}
    bench = [python, "-m", "benchmarks.bench", "--short", "--accelerator", "gpu", "--out", str(out / "bench")]
    tier = [python, "-m", "pytest", "-m", "gpu", "-n", "0", "-v", "-rA", "-p", "no:cacheprovider"]
    every = {
        **{half: ([*tier, *(f"tests/{name}" for name in files)], {}) for half, files in TIER_FILES.items()},
        "main": (["./scripts/run_ddp_train.sh", ",".join(map(str, range(gpus))), "0"], run),
        "bench": (bench, {}),
    }
    return {part: every[part] for part in parts}


def run_step(name: str, command: list[str], env: dict[str, str], out: Path) -> tuple[int, str, float]:
    """Run ``command``, its output shown and written to ``out`` with the seconds since it began on every line; its
    status, output and seconds."""
    print(f"==== {name}: {' '.join(command)}", flush=True)
    started = time.monotonic()
    log = out / f"{re.sub(r'[^a-z]+', '_', name.lower())}.log"
    lines = []
    with (
        log.open("w") as file,
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        ) as process,
    ):
        for line in process.stdout:
            print(line, end="", flush=True)
            file.write(f"{time.monotonic() - started:5.0f} s | {line}")
            file.flush()
            lines.append(line)
    return process.returncode, "".join(lines), time.monotonic() - started


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


def step_lines(results: dict[str, tuple[int, str, float]]) -> list[str]:
    """The summary's lines of every step, in order, from the status, output and seconds of each part run: the tier's
    counts with its failing tests, the others' status, the benchmark's headlines; "not run in this call" for the
    rest."""
    lines = []
    for part, name in PARTS.items():
        if part not in results:
            lines.append(f"{name}: not run in this call")
            continue
        status, output, seconds = results[part]
        if part in TIER_FILES:
            failed = [line for line in output.splitlines() if line.startswith(("FAILED ", "ERROR "))]
            lines += [f"{name}: {test_counts(output)} ({seconds:.0f} s)", *(f"  {line}" for line in failed)]
            continue
        lines.append(f"{name}: {'ok' if status == 0 else f'failed with status {status}'} ({seconds:.0f} s)")
        if part == "bench":
            lines += [f"  {line}" for line in bench_headlines(output)]
    return lines


def machine() -> list[str]:
    """The GPUs, driver and versions, read once the steps' packages are importable (the doctor needs them)."""
    import lightning

    from training.config.gpu_support import driver_version

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
    parser.add_argument(
        "--only", action="append", choices=PARTS, help="run this part only; repeat for more (default: every part)"
    )
    options = parser.parse_args()
    parts = [part for part in PARTS if part in (options.only or PARTS)]
    fill = "fill it as DEVELOPERS.md says (A GPU machine without internet), on a machine with internet"
    if not options.wheels.is_dir():
        refuse(f"the wheels folder {options.wheels} does not exist: {fill}, and copy it here.")
    wheels = wheels_to_install(options.wheels, parts)
    if missing := missing_pins(wheels, parts):
        refuse(
            f"this Python ({sys.executable}) lacks {', '.join(missing)}, and {options.wheels} has no wheel of "
            f"{'it' if len(missing) == 1 else 'them'}: {fill}, with these pins too."
        )
    out = options.out or Path(tempfile.gettempdir()) / f"gpu-tier-{int(time.time())}"
    install = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps"]
    install += [str(wheel) for wheel in wheels]
    if options.dry_run:
        print(f"would install: {' '.join(install) if wheels else 'nothing, every wheel is installed already'}")
        for part, (command, settings) in steps(out, 1, parts).items():
            print(f"would run ({PARTS[part]}): {' '.join([*(f'{k}={v}' for k, v in settings.items()), *command])}")
        return 0
    if not torch.cuda.is_available():
        refuse(
            f"torch {torch.__version__} sees no CUDA GPU here (CUDA build: {torch.version.cuda or 'none'}), and "
            "this check is for a GPU machine. On CPU, run README's test command; here, --dry-run shows the steps."
        )
    out.mkdir(parents=True, exist_ok=True)
    if wheels and subprocess.run(install).returncode != 0:
        refuse(f"pip could not install the wheels of {options.wheels} (above); nothing was run.")
    importlib.invalidate_caches()  # what pip just installed, for machine()'s imports
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHON": sys.executable}
    results = {
        part: run_step(PARTS[part], command, env | settings, out)
        for part, (command, settings) in steps(out, torch.cuda.device_count(), parts).items()
    }
    lines = step_lines(results)
    installed = ", ".join(wheel.name.split("-")[0] for wheel in wheels) or "nothing"
    lines += [*machine(), f"installed from {options.wheels}: {installed}; every step's output in {out}"]
    print("==== summary", *lines, sep="\n")
    return 0 if all(status == 0 for status, _, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
