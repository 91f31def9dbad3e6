"""The short mode of benchmarks/bench.py: the step-time comparisons alone, in 5 interleaved rounds of every side,
sized to end within 5 minutes on one H100, the start-up of every run included, so that it fits a short GPU rental
beside the GPU tier (scripts/gpu_tier.py runs it).

    python -m benchmarks.bench --short --accelerator gpu

Rows: toy and seq2seq, each with a process per GPU (2 where there are 2 GPUs; 1 on the CPU, as on one GPU). Sides
of every row: the template, plain Lightning, the raw loop, the template without training.StepTime, and the template
without logger and progress bar, which runs with the same logger as plain Lightning (none). Left out: the rows with
fewer processes, and the start-up comparison of ``cli.py --help`` against an import of Lightning (the CPU
benchmark's; 5 rounds of it would take about 25 s); the first step's seconds after launch are still read from the
template's runs.

The arithmetic of the budget (``planned_seconds``), one H100, one process a row:

    runs      2 rows x 5 sides x 5 rounds = 50 launches
    launches  50 x 4.5 s from launch to exit besides the steps (imports, CUDA and NCCL start, set-up, teardown)
              = 225 s
    steps     toy: 25 runs x 211 steps x 2 ms = 11 s; seq2seq: 25 runs x 71 steps x 10 ms = 18 s
    the rest  the benchmark's own start and the data path, on the CPU: 5 s
    total     258 s, 42 s under the budget of 300 s: it holds while a launch takes at most 5.3 s on average

Every figure of that arithmetic is an estimate, LAUNCH_S above all (on the 2-core CPU VM of docs/performance.md a
launch to exit takes 6.5 to 8 s with both cores busy; the first GPU run, one round on an H200, saw 11.1 s from the
template's launch to its first step, the machine's first start of torch). So the mode measures itself: it prints
the median launch-to-exit seconds of each side, its own elapsed time, and a warning when that is over the budget.
The budget follows ``--rounds``: 60 s a round; fewer than 5 rounds are refused, but with --quick (the plumbing).
"""

import argparse
import time

import torch

BUDGET_S = 300.0
ROUNDS = 5
WARMUP = 10
# The toy model's timed steps stay within an epoch on 2 GPUs (65,536 samples of 128, 256 steps a process): an epoch's
# end saves a checkpoint, which is not a step.
STEPS = {"toy": 200, "seq2seq": 60}
LAUNCH_S = 4.5
STEP_MS = {"toy": 2.0, "seq2seq": 10.0}
REST_S = 5.0


def process_counts(accelerator: str) -> dict[str, tuple[int, ...]]:
    """One row per workload: a process per GPU, at most 2; one process on the CPU."""
    processes = min(2, torch.cuda.device_count()) if accelerator == "gpu" else 1
    return {"toy": (processes,), "seq2seq": (processes,)}


def budget_s(rounds: int) -> float:
    return BUDGET_S * rounds / ROUNDS


def planned_seconds(args: argparse.Namespace, sides_of_row) -> tuple[int, float]:
    """How many runs the plan holds, and the seconds the docstring's arithmetic gives them on one H100."""
    runs, seconds = 0, REST_S
    for workload, counts in args.processes.items():
        steps = args.warmup + args.steps[workload] + 1
        for processes in counts:
            launches = len(sides_of_row(args, workload, processes)) * args.rounds
            runs += launches
            seconds += launches * (LAUNCH_S + steps * STEP_MS[workload] / 1e3)
    return runs, seconds


def plan_line(args: argparse.Namespace, sides_of_row) -> str:
    runs, seconds = planned_seconds(args, sides_of_row)
    return (
        f"short mode: {runs} runs in {args.rounds} round{'s' if args.rounds > 1 else ''}, about {seconds:.0f} s on "
        f"one H100 by the estimate of benchmarks/short.py; budget {budget_s(args.rounds):.0f} s"
    )


def elapsed_line(started: float, short: bool, rounds: int) -> str:
    """The seconds since ``started`` (time.monotonic), against the short mode's budget."""
    elapsed = time.monotonic() - started
    if not short:
        return f"took {elapsed:.0f} s from start to end"
    budget = budget_s(rounds)
    if elapsed <= budget:
        return f"short mode: took {elapsed:.0f} s from start to end, within its budget of {budget:.0f} s"
    return (
        f"warning: the short mode took {elapsed:.0f} s from start to end, over its budget of {budget:.0f} s "
        "(5 minutes on one H100 for 5 rounds); the runs line above says which sides' launches took the time"
    )
