"""The template against raw PyTorch, side by side: training steps, the data path, logging and start-up.

    python benchmarks/bench.py [--quick] [--rounds N] [--out benchmarks/results]   # or python -m benchmarks.bench
    python benchmarks/bench.py --accelerator gpu [...]   # the same, every side on GPUs
    python benchmarks/bench.py --short --accelerator gpu  # 5 rounds of the step rows in 5 minutes on one H100

--rounds sets the rounds of every comparison (default 5, 1 with --quick); ``--rounds 1`` is a quick look
at the full sizes, one run per side and row. --accelerator gpu trains every side with one GPU per process
over NCCL, with 1 and 2 processes where there are 2 GPUs, 1 where there is one; a step is timed once the
GPU has reached it (a CUDA event, read after the last step: benchmarks/timing.py). The data path is measured on
the CPU either way. --short runs the step-time comparisons alone, one row per workload with a process per GPU, every
side in 5 rounds, sized for 5 minutes on one H100 with every run's start-up (benchmarks/short.py); it prints its
plan, its elapsed time and a warning when that is over budget.

1. Step time of the template (``python cli.py fit`` with configs/ddp.yaml, its DDPStrategy, callbacks and
   data path) against benchmarks/raw_ddp.py (DistributedDataParallel, DistributedSampler, the same
   DataLoader, model, batch, seed and threads), for the toy model and the seq2seq example, with 1 and 2
   processes on gloo (or NCCL); and how far their weights end apart after the same steps. A third side,
   benchmarks/lightning_only.py (a plain Trainer), splits the difference into what Lightning's loop costs
   and what the template adds to it.
   On every row, the template without training.StepTime gives what measuring where the step time goes costs.
2. The data path alone: a per-sample collate against the template's whole-batch indexing.
3. Logging: the default config (TensorBoard, progress bar) against no logger and no progress bar, as a
   fifth side of the toy model's comparison with the most processes (2, or 1 on one GPU), and of every row with
   --short or --quick, where it also gives the template over Lightning with the same logger (none).
4. Start-up: ``python cli.py --help`` against ``python -c "import lightning"``, and the time from launch to
   the first training step of that job.

Runs alternate (A/B/C, B/C/A, ...); a step time is the median over the rounds of each run's median step
time after warm-up, a ratio the median over the rounds of the ratio of that round's two runs, with its
lowest and highest. It prints a table headed by the accelerator, its device and torch's version, each ratio with
its spread, the clock the steps were timed by and each side's seconds from launch to exit; writes bench.json and
bench.png (which say them too) to --out; prints how long it took; and ends with two lines, the largest
template/Lightning and template/raw ratios over the rows::

    worst template/Lightning step-time ratio: X.XX
    worst template/raw step-time ratio: X.XX

--quick runs tiny models for a few steps in one round, the toy model with the most processes and seq2seq with 1
(with --short, the short mode's rows), every side on every row: for the tests. The chart needs matplotlib (pip
install -r requirements-charts.txt); without it the benchmark measures and prints everything and says the chart was
skipped.
Each run of a side is stopped, with every process it started, after --side-timeout seconds (default 600), and
named: a side that hangs ends the benchmark with its name.
"""

import argparse
import importlib.util
import json
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

STARTED = time.monotonic()  # before torch's import: the short mode's budget counts the whole command

# Run by its path, Python puts benchmarks/ first on the path, not the repo that holds the package.
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks import short
from benchmarks.comparisons import compare_data_path, compare_startup, compare_steps, row_sides
from benchmarks.report import chart, table
from benchmarks.sides import SideFailed
from benchmarks.timing import CLOCKS
from benchmarks.workloads import ACCELERATORS, REPO, STEP_WORKLOADS, device_problem


def process_counts(quick: bool, accelerator: str) -> dict[str, tuple[int, ...]]:
    """The process counts of each workload's rows: 1 and 2, on GPUs no more than there are. Quick mode keeps one
    row per workload: toy with the most processes (the row logging is measured on), seq2seq with 1."""
    most = 2 if accelerator == "cpu" else min(2, torch.cuda.device_count())
    if quick:
        return {"toy": (most,), "seq2seq": (1,)}
    return dict.fromkeys(STEP_WORKLOADS, tuple(range(1, most + 1)))


def size(args: argparse.Namespace) -> None:
    """The rounds, rows, warm-up and timed steps of the mode asked for: --quick's tiny sizes (the short mode's rows
    with --short), --short's (benchmarks/short.py), or the full comparison's."""
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.processes = (
        short.process_counts(args.accelerator) if args.short else process_counts(args.quick, args.accelerator)
    )
    if args.quick:
        args.warmup, args.steps = 2, {"toy": 5, "seq2seq": 3}
    elif args.short:
        args.warmup, args.steps = short.WARMUP, dict(short.STEPS)
    else:
        args.warmup, args.steps = 10, {"toy": 100, "seq2seq": 60}


def device_name(accelerator: str) -> str:
    """The GPU's name, or the CPU's model."""
    if accelerator == "gpu":
        return torch.cuda.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else None
    return model.group(1).strip() if model else platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny models, one row per workload, few steps, one round: checks the plumbing",
    )
    parser.add_argument(
        "--short",
        action="store_true",
        help="the step-time rows alone, a process per GPU, 5 rounds within 5 minutes on one H100 (benchmarks/short.py)",
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds per comparison (default 5, quick 1); 1 for a quick look"
    )
    parser.add_argument(
        "--accelerator",
        choices=ACCELERATORS,
        default="cpu",
        help="where every side trains: CPU processes on gloo, or one GPU per process on NCCL",
    )
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where bench.json and .png go")
    parser.add_argument(
        "--side-timeout",
        type=float,
        default=600,
        help="seconds one run of a side may take before it is stopped and named (default 600)",
    )
    args = parser.parse_args()
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.short and not args.quick and args.rounds is not None and args.rounds < short.ROUNDS:
        parser.error(
            f"--rounds {args.rounds} with --short: the short mode runs at least {short.ROUNDS} rounds, for a spread to "
            f"judge its goals by; leave --rounds out, or give {short.ROUNDS} or more (--quick checks the plumbing in 1)"
        )
    if problem := device_problem(args.accelerator, 1):
        parser.error(problem)
    if args.side_timeout <= 0:
        parser.error(f"--side-timeout must be a positive number of seconds, got {args.side_timeout:g}")
    size(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        if args.short:
            print(short.plan_line(args, row_sides), flush=True)
        print("training steps, template against raw and Lightning:", flush=True)
        try:
            steps, logging, first_steps = compare_steps(args, work)
            data_path = compare_data_path(args)
            if args.short:
                startup = {"first_step_s": statistics.median(first_steps)}
            else:
                startup = compare_startup(args, work, first_steps)
        except SideFailed as failure:
            print(failure.output[-3000:], file=sys.stderr)
            sys.exit(f"error: {failure} Nothing was written to {out}.")
        results = {
            "accelerator": args.accelerator,
            "device": device_name(args.accelerator),
            "torch": torch.__version__,
            "clock": CLOCKS[args.accelerator],
            "quick": args.quick,
            "short": args.short,
            "rounds": args.rounds,
            "cores": len(os.sched_getaffinity(0)),
            "steps": steps,
            "logging": logging,
            "data_path": data_path,
            "startup": startup,
        }
    results["worst_ratio"] = max(row["ratio"]["median"] for row in results["steps"])
    results["worst_step_time_cost"] = max(row["step_time_cost"]["median"] for row in results["steps"])
    results["worst_lightning_ratio"] = max(row["template_over_lightning"]["median"] for row in results["steps"])
    (out / "bench.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"wrote {out / 'bench.json'}; skipped the chart bench.png, which needs matplotlib: pip install -r "
            "requirements-charts.txt"
        )
    else:
        chart(results, out / "bench.png")
        print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    print(short.elapsed_line(STARTED, args.short, args.rounds))
    print(f"worst template/Lightning step-time ratio: {results['worst_lightning_ratio']:.2f}")
    print(f"worst template/raw step-time ratio: {results['worst_ratio']:.2f}")


if __name__ == "__main__":
    main()
