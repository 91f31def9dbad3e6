"""The benchmark's short mode (``--short``, benchmarks/short.py) and its step clock, where there is no GPU: the plan
and its budget's arithmetic, rounds that interleave every side of every row, each ratio printed with its spread,
the elapsed time with a warning over budget, a GPU clock that waits once, after the last step. The sides run for
real in tests/test_bench.py: quick mode runs every side of the short mode on every row."""

import argparse
import json
import re
import sys
import time

import pytest
import torch

from tests.helpers import SINGLE_PROCESS

SIDES = ["template", "lightning", "raw", "untimed", "quiet"]
MODULES = {"benchmarks.lightning_only": "lightning", "benchmarks.raw_ddp": "raw"}


def sized(**options) -> argparse.Namespace:
    from benchmarks.bench import size

    args = argparse.Namespace(**{"quick": False, "short": False, "rounds": None, "accelerator": "cpu", **options})
    size(args)
    return args


@pytest.mark.parametrize(("gpus", "processes"), [(1, 1), (2, 2), (8, 2)])
def test_the_short_mode_has_one_row_per_workload_with_a_process_per_gpu(gpus, processes, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    args = sized(short=True, accelerator="gpu")
    assert args.processes == {"toy": (processes,), "seq2seq": (processes,)}
    assert args.rounds == 5
    assert sized(short=True, accelerator="cpu").processes == {"toy": (1,), "seq2seq": (1,)}


def test_on_one_h100_the_plan_is_50_runs_within_the_budget_its_docstring_works_out(monkeypatch):
    from benchmarks import short
    from benchmarks.comparisons import row_sides
    from benchmarks.workloads import WORKLOADS

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    args = sized(short=True, accelerator="gpu")
    runs, seconds = short.planned_seconds(args, row_sides)
    # Every side on both rows, the side without logging included: 2 x 5 x 5.
    assert runs == 50 and seconds <= short.BUDGET_S
    assert f"total     {seconds:.0f} s, {short.BUDGET_S - seconds:.0f} s under the budget of 300 s" in short.__doc__
    launches_s = seconds - short.REST_S - runs * short.LAUNCH_S  # the steps' share
    allowance = (short.BUDGET_S - short.REST_S - launches_s) / runs
    assert f"it holds while a launch takes at most {allowance:.1f} s on average" in short.__doc__
    # The toy model's timed steps end before its epoch does on 2 GPUs, where an epoch's end would save a checkpoint.
    sizes = dict(o.removeprefix("--data.init_args.").split("=") for o in WORKLOADS["toy"].overrides)
    assert args.warmup + args.steps["toy"] + 1 < int(sizes["num_train"]) // int(sizes["batch_size"]) // 2


def fake_sides(monkeypatch, tmp_path) -> list[tuple]:
    """Every side's runs, recorded instead of trained, with known step times: the template 1% (toy) or 2%
    (seq2seq) slower than Lightning each round, starting even; without StepTime 0.5% faster than the template;
    without logging 1% slower than Lightning; the raw loop twice as fast as Lightning."""
    from benchmarks import comparisons

    runs = []

    def record(side: str, args: tuple):
        workload, processes, steps, quick, accelerator, work, name, *_ = args
        round_ = int(name.rpartition("-")[2])
        runs.append((workload, processes, round_, side))
        template = 2.0 * (1 + (0.01 if workload == "toy" else 0.02) * round_)
        step_ms = {"template": template, "lightning": 2.0, "raw": 1.0, "untimed": template / 1.005, "quiet": 2.02}
        path = tmp_path / f"{name}.json"
        starts = [i * step_ms[side] / 1e3 for i in range(steps)]
        path.write_text(json.dumps({"starts": starts, "first_step_wall": 10.0 + round_, "launched": 5.0}))
        torch.save({"weight": torch.zeros(2)}, path.with_suffix(".pt"))
        return path

    monkeypatch.setattr(comparisons, "template_run", lambda *args, bound: record("template", args))
    monkeypatch.setattr(comparisons, "module_run", lambda module, *args, bound: record(MODULES[module], args))
    monkeypatch.setattr(comparisons, "untimed_run", lambda *args, bound: record("untimed", args))
    monkeypatch.setattr(comparisons, "quiet_run", lambda *args, bound: record("quiet", args))
    return runs


@pytest.mark.parametrize("mode", ["short", "full"])
def test_every_round_runs_every_side_of_a_row_once_each_round_starting_with_the_next(mode, monkeypatch, tmp_path):
    from benchmarks.comparisons import compare_steps

    runs = fake_sides(monkeypatch, tmp_path)
    args = sized(short=mode == "short", side_timeout=60)
    rows, _, _ = compare_steps(args, tmp_path)
    # The short mode runs every side on both rows; the full one runs without logging on the logged row only.
    quiet_rows = {("toy", 1), ("seq2seq", 1)} if mode == "short" else {("toy", 2)}
    expected = []
    for workload, counts in args.processes.items():
        for processes in counts:
            sides = SIDES if (workload, processes) in quiet_rows else SIDES[:4]
            for round_ in range(5):
                turn = round_ % len(sides)
                expected += [(workload, processes, round_, side) for side in sides[turn:] + sides[:turn]]
    assert runs == expected
    assert {(r["workload"], r["processes"]) for r in rows if "quiet_over_lightning" in r} == quiet_rows
    for row in rows:
        assert set(row["run_s"]) == set(SIDES if "quiet_over_lightning" in row else SIDES[:4])


def test_the_short_mode_prints_its_plan_every_ratio_with_its_spread_and_its_time(monkeypatch, tmp_path, capsys):
    from benchmarks import bench

    fake_sides(monkeypatch, tmp_path)
    data_path = {"per_sample_us": 9.0, "whole_batch_us": 3.0, "speedup": 3.0}
    monkeypatch.setattr(bench, "compare_data_path", lambda args: data_path)
    monkeypatch.setattr(bench, "compare_startup", lambda *args: pytest.fail("the short mode compared start-ups"))
    monkeypatch.setattr(bench, "STARTED", time.monotonic())
    monkeypatch.setattr(sys, "argv", ["bench", "--short", "--out", str(tmp_path / "out")])
    bench.main()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == (
        "short mode: 50 runs in 5 rounds, about 258 s on one H100 by the estimate of benchmarks/short.py; budget 300 s"
    )
    for line in (
        "step clock: time.perf_counter() at the start of each step",
        "ratios, median of the rounds (lowest-highest round):",
        "  template/Lightning: toy 1p 1.020 (1.000-1.040), seq2seq 1p 1.040 (1.000-1.080)",
        "  template/Lightning, both without logger and progress bar: toy 1p 1.010 (1.010-1.010), "
        "seq2seq 1p 1.010 (1.010-1.010)",
        "  Lightning/raw: toy 1p 2.000 (2.000-2.000), seq2seq 1p 2.000 (2.000-2.000)",
        "step-time measurement (training.StepTime), cost per row: toy 1p +0.5% (+0.5% to +0.5%), "
        "seq2seq 1p +0.5% (+0.5% to +0.5%)",
        "logging (toy, 1 process): default 2.04 ms/step, no logger and no progress bar 2.02 ms/step, cost +1.0% "
        "(rounds -1.0% to +3.0%)",
        # The first steps came 5 to 9 s after launch: the median.
        "start-up: first training step of a 1-process job 7.0 s after launch",
    ):
        assert line in lines
    runs = next(line for line in lines if line.startswith("runs, "))
    side = r"\d+\.\d"
    assert re.fullmatch(
        rf"runs, seconds from launch to exit \(median of the rounds\): toy 1p template {side}, lightning {side}, raw "
        rf"{side}, untimed {side}, quiet {side}; seq2seq 1p template {side}, lightning {side}, raw {side}, untimed "
        rf"{side}, quiet {side}",
        runs,
    )
    assert re.fullmatch(r"short mode: took \d+ s from start to end, within its budget of 300 s", lines[-3])
    assert lines[-2:] == ["worst template/Lightning step-time ratio: 1.04", "worst template/raw step-time ratio: 2.08"]


@pytest.mark.parametrize("rounds", ["1", "4"])
def test_the_short_mode_refuses_fewer_than_5_rounds_but_for_the_plumbing(rounds, monkeypatch, capsys, tmp_path):
    from benchmarks import bench

    monkeypatch.setattr(sys, "argv", ["bench", "--short", "--rounds", rounds, "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    assert (
        f"error: --rounds {rounds} with --short: the short mode runs at least 5 rounds, for a spread to judge its "
        "goals by; leave --rounds out, or give 5 or more (--quick checks the plumbing in 1)"
    ) in capsys.readouterr().err
    assert sized(short=True, quick=True, rounds=1).rounds == 1
    assert list(tmp_path.iterdir()) == []


def test_a_short_mode_over_its_budget_says_so_in_a_warning(monkeypatch):
    from benchmarks import short

    line = short.elapsed_line(time.monotonic() - 400, short=True, rounds=5)
    took = re.fullmatch(
        r"warning: the short mode took (\d+) s from start to end, over its budget of 300 s \(5 minutes on one H100 "
        r"for 5 rounds\); the runs line above says which sides' launches took the time",
        line,
    )
    assert took and int(took[1]) >= 400, line
    # 10 rounds have twice the budget; the full comparison has none.
    assert short.elapsed_line(time.monotonic() - 400, short=True, rounds=10).startswith("short mode: took ")
    assert re.fullmatch(r"took \d+ s from start to end", short.elapsed_line(time.monotonic() - 400, False, 5))


def test_on_a_gpu_the_step_clock_records_an_event_a_step_and_waits_once_after_the_last(monkeypatch):
    from benchmarks.timing import StepMarks

    waits = []

    class Event:
        """A CUDA event whose GPU reaches it at ``Event.gpu_ms``; it can be read once waited for, as CUDA's."""

        gpu_ms = 0.0

        def __init__(self, enable_timing: bool = False) -> None:
            assert enable_timing

        def record(self, stream=None) -> None:
            self.at = Event.gpu_ms

        def synchronize(self) -> None:
            waits.append(self)

        def elapsed_time(self, end: "Event") -> float:
            assert waits, "read before the GPU finished"
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append("synchronize"))
    marks = StepMarks(torch.device("cuda", 0))
    for gpu_ms in (100.0, 112.5, 125.0, 150.0):
        Event.gpu_ms = gpu_ms
        marks.mark()
    assert waits == [], "a step waited for the GPU"
    assert marks.seconds() == [0.0, 0.0125, 0.025, 0.05]
    assert waits == [marks.stamps[-1]]


@pytest.mark.parametrize("workload", ["toy", "seq2seq"])
def test_the_side_without_logging_has_no_logger_and_no_bar_and_every_other_callback(
    workload, tmp_path, monkeypatch, run_cli
):
    from lightning.pytorch.callbacks import ProgressBar

    from benchmarks import sides
    from benchmarks.workloads import WORKLOADS

    given = []
    monkeypatch.setattr(sides, "template_run", lambda *args, bound: given.append(args[7:]) or tmp_path)
    sides.quiet_run(workload, 1, 5, True, "cpu", tmp_path, "quiet", bound=60)
    configs = WORKLOADS[workload].arguments(True, tmp_path / "cache", "cpu")
    cli = run_cli("fit", *configs, *SINGLE_PROCESS, "--trainer.fast_dev_run=1")
    quiet = run_cli("fit", *configs, *given[0], *SINGLE_PROCESS, "--trainer.fast_dev_run=1")
    names = [{type(callback).__name__ for callback in run.trainer.callbacks} for run in (cli, quiet)]
    assert names[0] - names[1] == {"ProgressBar"}
    assert quiet.trainer.loggers == [] and cli.trainer.loggers != []
    assert not any(isinstance(callback, ProgressBar) for callback in quiet.trainer.callbacks)
