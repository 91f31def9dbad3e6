"""The template against raw PyTorch, side by side: training steps, the data path, logging and start-up.

    python benchmarks/bench.py [--quick] [--rounds N] [--out benchmarks/results]   # or python -m benchmarks.bench
    python benchmarks/bench.py --accelerator gpu [...]   # the same, every side on GPUs

--rounds sets the rounds of every comparison (default 5, 1 with --quick); ``--rounds 1`` is a quick look
at the full sizes, one run per side and row. --accelerator gpu trains every side with one GPU per process
over NCCL, with 1 and 2 processes where there are 2 GPUs, 1 where there is one; a step is timed once the
GPU has finished it (benchmarks/timing.py). The data path is measured on the CPU either way.

1. Step time of the template (``python cli.py fit`` with configs/ddp.yaml, its DDPStrategy, callbacks and
   data path) against benchmarks/raw_ddp.py (DistributedDataParallel, DistributedSampler, the same
   DataLoader, model, batch, seed and threads), for the toy model and the seq2seq example, with 1 and 2
   processes on gloo (or NCCL); and how far their weights end apart after the same steps. A third side,
   benchmarks/lightning_only.py (a plain Trainer), splits the difference into what Lightning's loop costs
   and what the template adds to it.
   On every row, the template without training.StepTime gives what measuring where the step time goes costs.
2. The data path alone: a per-sample collate against the template's whole-batch indexing.
3. Logging: the default config (TensorBoard, progress bar) against no logger and no progress bar, as a
   fourth side of the toy model's comparison with the most processes (2, or 1 on one GPU).
4. Start-up: ``python cli.py --help`` against ``python -c "import lightning"``, and the time from launch to
   the first training step of that job.

Runs alternate (A/B/C, B/C/A, ...); a step time is the median over the rounds of each run's median step
time after warm-up, a ratio the median over the rounds of the ratio of that round's two runs, with its
lowest and highest. It prints a table headed by the accelerator, its device and torch's version, writes
bench.json and bench.png (which say them too) to --out, and ends with two lines, the largest
template/Lightning and template/raw ratios over the rows::

    worst template/Lightning step-time ratio: X.XX
    worst template/raw step-time ratio: X.XX

--quick runs tiny models for a few steps, the toy model with the most processes and seq2seq with 1 (for the
tests). The chart needs matplotlib (pip install -r requirements-charts.txt); without it the benchmark measures
and prints everything and says the chart was skipped. Each run of a side is stopped, with every process it started,
after --side-timeout seconds (default 600), and named: a side that hangs ends the benchmark with its name.
"""

import argparse
import importlib.util
import itertools
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

# Run by its path, Python puts benchmarks/ first on the path, not the repo that holds the package.
if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import yaml

from benchmarks.workloads import ACCELERATORS, REPO, WORKLOADS, device_problem


def median_step(record: Path, warmup: int) -> float:
    """The median time between consecutive step starts, after ``warmup`` steps."""
    starts = json.loads(record.read_text())["starts"][warmup:]
    return statistics.median(b - a for a, b in itertools.pairwise(starts))


class SideFailed(Exception):
    """A run of one side that failed or did not finish: its paragraph, and the end of its output."""

    def __init__(self, paragraph: str, output: str):
        super().__init__(paragraph)
        self.output = output


def run(command: list[str], cwd: Path, bound: float) -> None:
    """Run ``command`` in ``cwd`` (named after the run) for at most ``bound`` seconds, or raise SideFailed."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("OMP_NUM_THREADS", None)  # every side sets its threads itself, the same way
    cwd.mkdir(exist_ok=True)
    log = cwd / "output.log"  # a file, not a pipe: a process left holding a pipe would keep the benchmark waiting
    # How the side is started, as a user would type it: python cli.py, python -m benchmarks.raw_ddp.
    shown = command[: 3 if command[1] == "-m" else 2]
    side = " ".join("python" if word == sys.executable else Path(word).name for word in shown)
    with log.open("w") as output:
        # A session of its own, so that stopping it stops every process it started (the ranks) too.
        process = subprocess.Popen(command, cwd=cwd, env=env, stdout=output, stderr=output, start_new_session=True)
    try:
        status = process.wait(timeout=bound)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        why = f"did not finish within {bound:g} s (--side-timeout) and was stopped, with every process it started"
        raise SideFailed(f"{side} (run {cwd.name}) {why}. Its output is above.", log.read_text()) from None
    if status != 0:
        why = f"failed with exit status {status}"
        raise SideFailed(f"{side} (run {cwd.name}) {why}. Its output is above.", log.read_text())


def template_command(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, record: Path, *extra: str
) -> list[str]:
    """``python cli.py fit`` for ``steps`` steps on ``processes`` processes, its step times written to ``record``."""
    return [
        sys.executable,
        str(REPO / "cli.py"),
        "fit",
        *WORKLOADS[workload].arguments(quick, work / "cache", accelerator),
        f"--trainer.devices={processes}",
        f"--trainer.max_steps={steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        *extra,
        "--trainer.callbacks+=benchmarks.timing.StepTimer",
        f"--trainer.callbacks.out={record}",
    ]


def template_run(
    workload: str,
    processes: int,
    steps: int,
    quick: bool,
    accelerator: str,
    work: Path,
    name: str,
    *extra: str,
    bound: float,
) -> Path:
    """Train with ``python cli.py fit``; the record also holds when the command was launched."""
    record = work / f"{name}.json"
    launched = time.time()
    command = template_command(workload, processes, steps, quick, accelerator, work, record, *extra)
    run(command, cwd=work / name, bound=bound)
    record.write_text(json.dumps({**json.loads(record.read_text()), "launched": launched}))
    return record


def quiet_run(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, name: str, *, bound: float
) -> Path:
    """The template without its logger and progress bar."""
    # refresh_rate applies to the last callback so far: the progress bar of configs/ddp.yaml.
    no_logging = ("--trainer.logger=false", "--trainer.callbacks.refresh_rate=0")
    return template_run(workload, processes, steps, quick, accelerator, work, name, *no_logging, bound=bound)


def untimed_run(
    workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, name: str, *, bound: float
) -> Path:
    """The template without training.StepTime: a config file after the workload's gives their callbacks but that
    one (in a file, where the entries' ${...} resolve as in the workload's own)."""
    callbacks: list[dict] = []
    for config in WORKLOADS[workload].configs:
        trainer = yaml.safe_load((REPO / config).read_text()).get("trainer", {})
        callbacks = trainer.get("callbacks", callbacks) + trainer.get("callbacks+", [])
    kept = [callback for callback in callbacks if callback["class_path"] != "training.StepTime"]
    untimed = work / f"untimed-{workload}.yaml"
    untimed.write_text(yaml.safe_dump({"trainer": {"callbacks": kept}}, sort_keys=False))
    return template_run(workload, processes, steps, quick, accelerator, work, name, "-c", str(untimed), bound=bound)


def module_command(
    module: str, workload: str, processes: int, steps: int, quick: bool, accelerator: str, work: Path, record: Path
) -> list[str]:
    """``python -m benchmarks.raw_ddp`` or ``benchmarks.lightning_only``: they take the same arguments. ``run`` puts
    the repo on PYTHONPATH, so the module is found from the run's own directory."""
    command = [
        sys.executable,
        "-m",
        module,
        "--workload",
        workload,
        "--processes",
        str(processes),
        "--accelerator",
        accelerator,
        "--steps",
        str(steps),
        "--out",
        str(record),
        "--data-dir",
        str(work / "cache"),
    ]
    return [*command, "--quick"] if quick else command


def module_run(
    module: str,
    workload: str,
    processes: int,
    steps: int,
    quick: bool,
    accelerator: str,
    work: Path,
    name: str,
    *,
    bound: float,
) -> Path:
    record = work / f"{name}.json"
    command = module_command(module, workload, processes, steps, quick, accelerator, work, record)
    run(command, cwd=work / name, bound=bound)
    return record


def max_weight_difference(a: Path, b: Path) -> float:
    # On the CPU: the weights of a GPU run were saved from its GPU.
    first, second = (torch.load(path.with_suffix(".pt"), map_location="cpu") for path in (a, b))
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def paired(numerator: list[float], denominator: list[float]) -> dict:
    """The median and range of the per-round ratios: each round's two runs ran back to back, so a slow spell
    of the machine that lasts longer than a round slows both."""
    ratios = [n / d for n, d in zip(numerator, denominator, strict=True)]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def compare_steps(args: argparse.Namespace, work: Path) -> tuple[list[dict], dict, list[float]]:
    """One row per workload and process count; what logging costs; and the seconds from launch to the first
    step of the template runs of the row logging is measured on."""
    rows, logging, first_steps = [], {}, []
    # Logging is measured on the toy model's row with the most processes: a fourth side there, the template
    # without logger or progress bar.
    logged_row = ("toy", max(args.processes["toy"]))
    sides = {
        "template": template_run,
        "lightning": partial(module_run, "benchmarks.lightning_only"),
        "raw": partial(module_run, "benchmarks.raw_ddp"),
    }
    for workload in WORKLOADS:
        steps = args.warmup + args.steps[workload] + 1
        for processes in args.processes[workload]:
            logged = (workload, processes) == logged_row
            # Every row measures what the step-time measurement costs: the template without training.StepTime.
            row_sides = {**sides, "untimed": untimed_run, **({"quiet": quiet_run} if logged else {})}
            medians: dict[str, list[float]] = {side: [] for side in row_sides}
            difference = 0.0
            for round_ in range(args.rounds):
                # The sides take turns to go first, so a slow spell at the start of a round hits each in turn.
                turn = round_ % len(row_sides)
                order = list(row_sides)[turn:] + list(row_sides)[:turn]
                records = {}
                for side in order:
                    name = f"{side}-{workload}-{processes}-{round_}"
                    run_side = row_sides[side]
                    records[side] = run_side(
                        workload, processes, steps, args.quick, args.accelerator, work, name, bound=args.side_timeout
                    )
                    medians[side].append(median_step(records[side], args.warmup))
                for side in ("template", "lightning"):
                    difference = max(difference, max_weight_difference(records[side], records["raw"]))
                if logged:
                    timing = json.loads(records["template"].read_text())
                    first_steps.append(timing["first_step_wall"] - timing["launched"])
            rows.append(
                {
                    "workload": workload,
                    "processes": processes,
                    **{f"{side}_step_ms": 1e3 * statistics.median(medians[side]) for side in sides},
                    "rounds_step_ms": {side: [1e3 * m for m in medians[side]] for side in sides},
                    "ratio": paired(medians["template"], medians["raw"]),
                    "lightning_over_raw": paired(medians["lightning"], medians["raw"]),
                    "template_over_lightning": paired(medians["template"], medians["lightning"]),
                    "max_weight_difference": difference,
                    "untimed_step_ms": 1e3 * statistics.median(medians["untimed"]),
                    "step_time_cost": {k: v - 1 for k, v in paired(medians["template"], medians["untimed"]).items()},
                }
            )
            if logged:
                cost = paired(medians["template"], medians["quiet"])
                logging = {
                    "processes": processes,
                    "default_step_ms": 1e3 * statistics.median(medians["template"]),
                    "quiet_step_ms": 1e3 * statistics.median(medians["quiet"]),
                    "cost": {key: value - 1 for key, value in cost.items()},
                }
            raw, lightning = rows[-1]["ratio"]["median"], rows[-1]["template_over_lightning"]["median"]
            print(f"  {workload}, {processes} process(es): {raw:.3f}x raw, {lightning:.3f}x Lightning", flush=True)
    return rows, logging, first_steps


def compare_data_path(args: argparse.Namespace) -> dict:
    from torch.utils.data import DataLoader, TensorDataset

    from data import RandomDataModule
    from data.random_data import batch_loader

    torch.set_num_threads(1)
    data = RandomDataModule(num_train=2048 if args.quick else 65536, batch_size=128)
    data.setup("fit")
    split = data.splits["train"]
    loaders = {
        "per_sample": DataLoader(TensorDataset(*split.tensors), batch_size=128, shuffle=True),
        "whole_batch": batch_loader(split, 128, shuffle=True, pin_memory=False),
    }
    timings: dict[str, list[float]] = {name: [] for name in loaders}
    for round_ in range(args.rounds + 1):
        for name, loader in loaders.items():
            start = time.perf_counter()
            batches = sum(1 for _ in loader)
            if round_:  # the first round warms up
                timings[name].append((time.perf_counter() - start) / batches)
    per_sample, whole_batch = (statistics.median(timings[name]) for name in loaders)
    return {"per_sample_us": 1e6 * per_sample, "whole_batch_us": 1e6 * whole_batch, "speedup": per_sample / whole_batch}


def compare_startup(args: argparse.Namespace, work: Path, first_steps: list[float]) -> dict:
    commands = {
        "cli_help": [sys.executable, str(REPO / "cli.py"), "--help"],
        "import_lightning": [sys.executable, "-c", "import lightning"],
    }
    timings: dict[str, list[float]] = {name: [] for name in commands}
    for _ in range(args.rounds):
        for name, command in commands.items():
            start = time.perf_counter()
            run(command, cwd=work / name, bound=args.side_timeout)
            timings[name].append(time.perf_counter() - start)
    help_s, import_s = (statistics.median(timings[name]) for name in commands)
    return {
        "cli_help_s": help_s,
        "import_lightning_s": import_s,
        "ratio": help_s / import_s,
        "first_step_s": statistics.median(first_steps),
    }


def process_counts(quick: bool, accelerator: str) -> dict[str, tuple[int, ...]]:
    """The process counts of each workload's rows: 1 and 2, on GPUs no more than there are. Quick mode keeps one
    row per workload: toy with the most processes (the row logging is measured on), seq2seq with 1."""
    most = 2 if accelerator == "cpu" else min(2, torch.cuda.device_count())
    if quick:
        return {"toy": (most,), "seq2seq": (1,)}
    return dict.fromkeys(WORKLOADS, tuple(range(1, most + 1)))


def device_name(accelerator: str) -> str:
    """The GPU's name, or the CPU's model."""
    if accelerator == "gpu":
        return torch.cuda.get_device_name(0)
    cpuinfo = Path("/proc/cpuinfo")
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo.read_text(), re.M) if cpuinfo.exists() else None
    return model.group(1).strip() if model else platform.machine()


def heading(results: dict) -> str:
    """What the steps ran on, at the head of the table and the chart: a GPU figure is never read as a CPU one."""
    return f"{results['accelerator']}: {results['device']}, {results['cores']} CPU cores, torch {results['torch']}"


def table(results: dict) -> str:
    logging, startup = results["logging"], results["startup"]
    logged = f"{logging['processes']} process{'es' if logging['processes'] > 1 else ''}"

    def ratio(r: dict) -> str:
        return f"{r['median']:.3f} ({r['low']:.2f}-{r['high']:.2f})"

    lines = [
        heading(results),
        "step time, median ms     template Lightning    raw   template/raw (rounds)  Lightning/raw  "
        "template/Lightning  max |weight diff|",
        *(
            f"{r['workload']:>8}, {r['processes']} process(es) {r['template_step_ms']:8.2f} "
            f"{r['lightning_step_ms']:8.2f} {r['raw_step_ms']:7.2f}   {ratio(r['ratio']):21}  "
            f"{r['lightning_over_raw']['median']:13.3f}  "
            f"{r['template_over_lightning']['median']:18.3f}  {r['max_weight_difference']:.1e}"
            for r in results["steps"]
        ),
        "",
        f"data path, us/batch of 128: per-sample collate {results['data_path']['per_sample_us']:.0f}, "
        f"whole-batch index {results['data_path']['whole_batch_us']:.0f} ({results['data_path']['speedup']:.1f}x)",
        "step-time measurement (training.StepTime), cost per row: "
        + ", ".join(
            f"{r['workload']} {r['processes']}p {100 * r['step_time_cost']['median']:+.1f}% "
            f"({100 * r['step_time_cost']['low']:+.1f}% to {100 * r['step_time_cost']['high']:+.1f}%)"
            for r in results["steps"]
        ),
        f"logging (toy, {logged}): default {logging['default_step_ms']:.2f} ms/step, no logger and no progress "
        f"bar {logging['quiet_step_ms']:.2f} ms/step, cost {100 * logging['cost']['median']:+.1f}% "
        f"(rounds {100 * logging['cost']['low']:+.1f}% to {100 * logging['cost']['high']:+.1f}%)",
        f"start-up: cli.py --help {startup['cli_help_s']:.2f} s, import lightning "
        f"{startup['import_lightning_s']:.2f} s ({startup['ratio']:.2f}x); first training step of a "
        f"{logging['processes']}-process job {startup['first_step_s']:.1f} s after launch",
    ]
    return "\n".join(lines)


def chart(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["steps"]
    labels = [f"{r['workload']}\n{r['processes']} proc" for r in rows]
    positions = range(len(rows))
    figure, axes = plt.subplots(figsize=(7, 4))
    for offset, (side, label) in zip(
        (-0.27, 0, 0.27),
        (("template", "template"), ("lightning", "Lightning alone"), ("raw", "raw DDP loop")),
        strict=True,
    ):
        axes.bar([p + offset for p in positions], [r[f"{side}_step_ms"] for r in rows], 0.27, label=label)
    for position, row in zip(positions, rows, strict=True):
        axes.annotate(
            f"{row['ratio']['median']:.2f}x",
            (position, max(row["template_step_ms"], row["lightning_step_ms"], row["raw_step_ms"])),
            ha="center",
            va="bottom",
        )
    axes.set_xticks(list(positions), labels)
    axes.set_ylabel("median step time (ms)")
    axes.set_title(f"step time, {heading(results)}\nlabels: template / raw", fontsize="medium")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


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
    if problem := device_problem(args.accelerator, 1):
        parser.error(problem)
    if args.side_timeout <= 0:
        parser.error(f"--side-timeout must be a positive number of seconds, got {args.side_timeout:g}")
    args.rounds = args.rounds or (1 if args.quick else 5)
    args.warmup = 2 if args.quick else 10
    args.steps = {"toy": 5, "seq2seq": 3} if args.quick else {"toy": 100, "seq2seq": 60}
    args.processes = process_counts(args.quick, args.accelerator)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        print("training steps, template against raw and Lightning:", flush=True)
        try:
            steps, logging, first_steps = compare_steps(args, work)
            data_path = compare_data_path(args)
            startup = compare_startup(args, work, first_steps)
        except SideFailed as failure:
            print(failure.output[-3000:], file=sys.stderr)
            sys.exit(f"error: {failure} Nothing was written to {out}.")
        results = {
            "accelerator": args.accelerator,
            "device": device_name(args.accelerator),
            "torch": torch.__version__,
            "quick": args.quick,
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
    print(f"worst template/Lightning step-time ratio: {results['worst_lightning_ratio']:.2f}")
    print(f"worst template/raw step-time ratio: {results['worst_ratio']:.2f}")


if __name__ == "__main__":
    main()
