"""What each layer costs a training step, in microseconds, on a workload of almost no compute (a step is all Python):
what Lightning adds to the raw loop, what the template adds to Lightning (bare, and with the same logger, log interval
and progress bar as the template: benchmarks/lightning_only.py --logged), and each of the template's callbacks and
its logger, measured as the template with that one turned off. One process on the CPU, so every machine sees the
cost that a fast GPU turns into a slower step.

    python -m benchmarks.overhead [--rounds 3] [--steps 2000] [--only StepTime,ProgressBar] [--clock cpu]

Runs alternate as in benchmarks/bench.py: each round runs every side once, each round starting with the next side.
A side's figure is the median over the rounds of its run's median step (after 50 warm-up steps); a callback's cost
is the median over the rounds of (template - template without it), with the lowest and highest round. With
``--clock cpu`` a step is the CPU time the process spent on it, every thread's, instead of the time it took: the
figure that other work on a busy machine changes least.
"""

import argparse
import statistics
import sys
import tempfile
from functools import partial
from pathlib import Path

if not __package__:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import yaml

from benchmarks.comparisons import median_step
from benchmarks.sides import SideFailed, module_run, template_run
from benchmarks.workloads import REPO

WARMUP = 50
CLOCKS = {"wall": "starts", "cpu": "cpu_starts"}  # the records' lists of step starts


def template_entries() -> list[str]:
    """The class names of configs/ddp.yaml's callbacks and plugins, as turn_off takes them."""
    trainer = yaml.safe_load((REPO / "configs" / "ddp.yaml").read_text())["trainer"]
    return [entry["class_path"].rpartition(".")[2] for entry in trainer["callbacks"] + trainer["plugins"]]


def sides(only: list[str]) -> dict:
    """Every side of the comparison, by name: how to run it once."""
    flags = {name: (f"--turn_off=[{name}]",) for name in only}
    if "logger" in flags:
        flags["logger"] = ("--trainer.logger=false",)
    if "ProgressBar" in flags:  # without any bar: Lightning's own would take its place, redrawn every step
        flags["ProgressBar"] += ("--trainer.enable_progress_bar=false",)
    return {
        "raw": partial(module_run, "benchmarks.raw_ddp"),
        "lightning": partial(module_run, "benchmarks.lightning_only"),
        "lightning+logger": lightning_logged,
        "template": template_run,
        **{f"without {name}": partial(template_without, flag) for name, flag in flags.items()},
    }


def template_without(flags: tuple[str, ...], *args, bound: float) -> Path:
    return template_run(*args, *flags, bound=bound)


def lightning_logged(*args, bound: float) -> Path:
    return module_run("benchmarks.lightning_only", *args, "--logged", bound=bound)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.overhead", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every side (default 3)")
    parser.add_argument("--steps", type=int, default=2000, help="timed steps of each run (default 2000)")
    parser.add_argument("--only", default="", help="the callbacks (and logger) to turn off in turn; default all")
    parser.add_argument("--side-timeout", type=float, default=600, help="seconds one run may take (default 600)")
    parser.add_argument(
        "--clock", choices=CLOCKS, default="wall", help="a step's time, or the CPU time it took (default wall)"
    )
    args = parser.parse_args()
    known = [*template_entries(), "logger"]
    only = [name for name in args.only.split(",") if name] or known
    if unknown := [name for name in only if name not in known]:
        parser.error(f"--only names {', '.join(unknown)}; the template has {', '.join(known)}")
    if args.rounds < 1 or args.steps < 10:
        parser.error("--rounds must be at least 1 and --steps at least 10")
    runs = sides(only)
    medians: dict[str, list[float]] = {side: [] for side in runs}
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        for round_ in range(args.rounds):
            order = list(runs)[round_ % len(runs) :] + list(runs)[: round_ % len(runs)]
            for number, side in enumerate(order, 1):
                print(f"round {round_ + 1}/{args.rounds}, run {number}/{len(order)}: {side}", flush=True)
                name = f"{side.replace(' ', '-')}-{round_}"
                try:
                    steps = WARMUP + args.steps + 1
                    record = runs[side]("null", 1, steps, False, "cpu", work, name, bound=args.side_timeout)
                except SideFailed as failure:
                    print(failure.output[-3000:], file=sys.stderr)
                    sys.exit(f"error: {failure}")
                medians[side].append(1e6 * median_step(record, WARMUP, CLOCKS[args.clock]))
    print(report(medians, args.rounds, args.clock))


def report(medians: dict[str, list[float]], rounds: int, clock: str = "wall") -> str:
    """The table: each side's microseconds a step, and what each layer and each callback adds."""

    def cost(more: str, less: str) -> str:
        differences = [a - b for a, b in zip(medians[more], medians[less], strict=True)]
        return f"{statistics.median(differences):+7.1f} us ({min(differences):+.1f} to {max(differences):+.1f})"

    lines = [
        f"per-step cost{' in CPU time' if clock == 'cpu' else ''} on a workload of almost no compute, 1 CPU process, "
        f"median of {rounds} rounds:",
        *(f"  {side:32} {statistics.median(values):8.1f} us/step" for side, values in medians.items()),
        f"  Lightning over the raw loop      {cost('lightning', 'raw')}",
        f"  template over Lightning          {cost('template', 'lightning')}",
        f"  the same, Lightning logging too  {cost('template', 'lightning+logger')}",
    ]
    lines += [f"  {side.removeprefix('without '):32} {cost('template', side)}" for side in medians if " " in side]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
