"""The seq2seq example's GPU settings against Lightning's defaults, and each setting alone: what each is worth.

    python -m benchmarks.gpu_defaults [--quick] [--rounds N] [--steps N] [--accelerator gpu] [--out DIR]
        [--side-timeout S]

Every side trains the seq2seq example of configs/ddp.yaml, configs/seq2seq.yaml and configs/seq2seq_gpu.yaml (the
same model, data, seed and number of steps) in one process under a plain Lightning Trainer, then validates once
(benchmarks/gpu_defaults_side.py). The sides differ only in the settings of CHOICES:

- ``plain``: Lightning's and torch's defaults for every one: float32 (``32-true``, ``matmul_precision: highest``),
  AdamW without ``fused``, batches made in the training process (``num_workers: 0``), pageable memory;
- ``gpu defaults``: the configs as they are;
- ``+bf16``, ``+tf32``, ``+fused``, ``+workers``, ``+pinned``: plain with that one setting as the configs have it.

Runs alternate as in benchmarks/bench.py (the sides take turns to go first). A side's step time is the mean over
its steps after warm-up: the span from the first to the end of training, read once the GPU has finished, over the
steps, so the process runs ahead of the GPU in between as training does, and epoch ends count (where workers not
kept start again). The figure is the median over the rounds, a speedup the median of each round's plain/side
ratio, with the lowest and highest round. Each line also gives the exact match the side reached on the held-out
sources (median over the rounds) and the settings it had in effect, read from its trainer, optimizer and loader.
The last line::

    gpu defaults against Lightning's defaults: X.XXx step time (rounds X.XX-X.XX), exact match X.XXX against X.XXX

--quick trains the small model of benchmarks/bench.py --quick for a few steps in one round: the plumbing, on CPU too.
On CPU ``+workers`` and ``+pinned`` are not run: the loader settings change nothing there (no workers by device,
nothing to pin), so each would be plain again. The results go to DIR/gpu_defaults.json (default benchmarks/results).
"""

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

if not __package__:  # run by its path: the repo, not benchmarks/, first on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from benchmarks.bench import device_name
from benchmarks.comparisons import paired
from benchmarks.sides import SideFailed, run
from benchmarks.workloads import ACCELERATORS, REPO, device_problem

# Each choice: (what the configs set, the cli.py flags that give Lightning's and torch's default instead).
CHOICES = {
    "bf16": ("trainer.precision", ("--trainer.precision=32-true",)),
    "tf32": ("matmul_precision", ("--matmul_precision=highest",)),
    "fused": ("fused AdamW", ("--model.init_args.optimizer.init_args.fused=false",)),
    "workers": (
        "data.num_workers, persistent_workers",
        ("--data.init_args.num_workers=0", "--data.init_args.persistent_workers=false"),
    ),
    "pinned": ("data.pin_memory", ("--data.init_args.pin_memory=false",)),
}
LOADER_CHOICES = ("workers", "pinned")  # the same as plain on CPU


def side_flags(accelerator: str) -> dict[str, tuple[str, ...]]:
    """Each side's flags over the configs: all of CHOICES' for plain, none for the GPU defaults, all but one's; on
    CPU, no side for a loader choice."""
    plain = {name: flags for name, (_, flags) in CHOICES.items()}
    sides = {"plain": sum(plain.values(), ()), "gpu defaults": ()}
    for name in CHOICES:
        if accelerator == "gpu" or name not in LOADER_CHOICES:
            sides[f"+{name}"] = sum((flags for other, flags in plain.items() if other != name), ())
    return sides


def mean_step(record: dict) -> float:
    """Seconds per step after warm-up, from the first timed step's start to the end of training."""
    return record["seconds"] / record["timed_steps"]


def describe(settings: dict) -> str:
    workers = settings["num_workers"]
    kept = ", kept" if settings["persistent_workers"] else ""
    return (
        f"{settings['precision']}, matmul {settings['matmul_precision']}, "
        f"{'fused' if settings['fused'] else 'unfused'} AdamW, {workers} worker{'s' * (workers != 1)}{kept}, "
        f"{'pinned' if settings['pin_memory'] else 'pageable'}"
    )


def measure(args: argparse.Namespace, work: Path) -> dict[str, list[dict]]:
    """Every side's records, one per round, the sides taking turns to go first."""
    sides = side_flags(args.accelerator)
    records: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        turn = round_ % len(sides)
        for side in list(sides)[turn:] + list(sides)[:turn]:
            name = f"{side.replace(' ', '-').lstrip('+')}-{round_}"
            out = work / f"{name}.json"
            command = [
                *(sys.executable, "-m", "benchmarks.gpu_defaults_side", "--out", str(out)),
                *("--accelerator", args.accelerator, "--steps", str(args.steps), "--warmup", str(args.warmup)),
                *("--data-dir", str(work / "cache")),
                *(("--quick",) if args.quick else ()),
                "--",
                *sides[side],
            ]
            run(command, cwd=work / name, bound=args.side_timeout)
            records[side].append(json.loads(out.read_text()))
        print(f"  round {round_ + 1} of {args.rounds} done", flush=True)
    return records


def summarise(records: dict[str, list[dict]]) -> dict[str, dict]:
    steps = {side: [mean_step(record) for record in runs] for side, runs in records.items()}
    return {
        side: {
            "step_ms": 1e3 * statistics.median(steps[side]),
            "rounds_step_ms": [1e3 * s for s in steps[side]],
            "speedup": paired(steps["plain"], steps[side]),
            "exact_match": statistics.median(record["exact_match"] for record in runs),
            "settings": runs[0]["settings"],
        }
        for side, runs in records.items()
    }


def table(results: dict) -> str:
    sides, heading = results["sides"], results["heading"]
    lines = [heading, f"{'side':>14}  ms/step  speedup over plain (rounds)  exact match  settings in effect"]
    for side, row in sides.items():
        speedup = row["speedup"]
        ranged = f"{speedup['median']:.2f}x ({speedup['low']:.2f}-{speedup['high']:.2f})"
        lines.append(
            f"{side:>14} {row['step_ms']:8.2f}  {ranged:27}  {row['exact_match']:11.3f}  {describe(row['settings'])}"
        )
    gpu, plain = sides["gpu defaults"], sides["plain"]
    lines.append(
        f"gpu defaults against Lightning's defaults: {gpu['speedup']['median']:.2f}x step time (rounds "
        f"{gpu['speedup']['low']:.2f}-{gpu['speedup']['high']:.2f}), exact match {gpu['exact_match']:.3f} against "
        f"{plain['exact_match']:.3f}"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gpu_defaults",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="a small model for a few steps, one round: the plumbing")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of every side (default 5, quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="training steps per run (default 1300, quick 4)")
    parser.add_argument("--accelerator", choices=ACCELERATORS, default="cpu", help="gpu: one CUDA GPU")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="where gpu_defaults.json goes")
    parser.add_argument("--side-timeout", type=float, default=900, help="seconds one run of a side may take")
    args = parser.parse_args()
    args.rounds = args.rounds if args.rounds is not None else (1 if args.quick else 5)
    # About two epochs of the example's 39,000 training pairs at batch 64, so that workers kept or started again
    # at an epoch's end show; quick: enough steps to time a few after warm-up.
    args.steps = args.steps if args.steps is not None else (4 if args.quick else 1300)
    args.warmup = 1 if args.quick else 50
    for flag, value, least in (("--rounds", args.rounds, 1), ("--steps", args.steps, args.warmup + 1)):
        if value < least:
            parser.error(f"{flag} must be at least {least}, got {value}")
    if problem := device_problem(args.accelerator, 1):
        parser.error(problem)
    heading = (
        f"seq2seq, 1 process, {args.accelerator}: {device_name(args.accelerator)}, torch {torch.__version__}; "
        f"{args.steps} steps ({args.warmup} warm-up), {args.rounds} round{'s' * (args.rounds > 1)}"
    )
    sides = len(side_flags(args.accelerator))
    print(f"{sides} sides, {args.rounds} round(s) of {args.steps} steps each:", flush=True)
    if args.accelerator == "cpu":
        print("  not run on cpu: +workers and +pinned, the same as plain there (no workers by device, nothing to pin)")
    with tempfile.TemporaryDirectory() as directory:
        try:
            records = measure(args, Path(directory))
        except SideFailed as failure:
            print(failure.output[-3000:], file=sys.stderr)
            sys.exit(f"error: {failure}")
    results = {"heading": heading, "quick": args.quick, "sides": summarise(records)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_defaults.json").write_text(json.dumps(results, indent=2))
    print(table(results))
    print(f"wrote {out / 'gpu_defaults.json'}")


if __name__ == "__main__":
    main()
