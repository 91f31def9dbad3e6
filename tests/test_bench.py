"""``python benchmarks/bench.py --quick``: every figure measured, written as JSON and drawn, same results; without
matplotlib, the same table; a side that does not finish, stopped and named."""

import json
import math
import os
import re
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from tests.helpers import REPO, SINGLE_PROCESS, charts_path, needs_gpus, run_script

SIDES = ("template", "lightning", "raw")


def with_charts() -> dict[str, str]:
    return {"PYTHONPATH": os.pathsep.join([str(REPO), charts_path()])}


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    # By its path, as a user runs a script, and without the repo on PYTHONPATH.
    command = [sys.executable, "benchmarks/bench.py", "--quick", "--out", str(out)]
    result = run_script(command, cwd=REPO, env={"PYTHONPATH": charts_path()}, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "bench.json").read_text()), result.stdout, out


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.distributed
def test_every_workload_and_process_count_is_timed_against_the_raw_loop(bench):
    results, _, _ = bench
    rows = results["steps"]
    assert sorted((r["workload"], r["processes"]) for r in rows) == [("seq2seq", 1), ("toy", 2)]
    # Quick mode runs every side on every row, the short mode's too: each runs on each workload.
    assert all(list(r["run_s"]) == [*SIDES, "untimed", "quiet"] for r in rows), [list(r["run_s"]) for r in rows]
    assert all("quiet_over_lightning" in r for r in rows)
    for row in rows:
        rounds = row["rounds_step_ms"]
        for side in SIDES:
            assert len(rounds[side]) == results["rounds"] and all(positive(v) for v in rounds[side]), row
            assert row[f"{side}_step_ms"] == pytest.approx(statistics.median(rounds[side]))
        for key, top, bottom in (
            ("ratio", "template", "raw"),
            ("lightning_over_raw", "lightning", "raw"),
            ("template_over_lightning", "template", "lightning"),
        ):
            pairs = [t / b for t, b in zip(rounds[top], rounds[bottom], strict=True)]
            assert row[key] == pytest.approx(
                {"median": statistics.median(pairs), "low": min(pairs), "high": max(pairs)}
            )
    assert results["worst_ratio"] == max(r["ratio"]["median"] for r in rows)
    assert results["worst_lightning_ratio"] == max(r["template_over_lightning"]["median"] for r in rows)


@pytest.mark.distributed
def test_template_lightning_alone_and_raw_loop_end_with_the_same_weights(bench):
    results, _, _ = bench
    for row in results["steps"]:
        assert row["max_weight_difference"] <= 1e-6, row


@pytest.mark.distributed
def test_logging_data_path_and_startup_figures_are_present(bench):
    results, _, _ = bench
    assert results["logging"]["processes"] == 2
    assert all(positive(results["logging"][k]) for k in ("default_step_ms", "quiet_step_ms"))
    # One round in quick mode: the median of the per-round costs is that round's.
    cost = results["logging"]["default_step_ms"] / results["logging"]["quiet_step_ms"] - 1
    assert results["logging"]["cost"] == pytest.approx({"median": cost, "low": cost, "high": cost})
    assert all(positive(v) for v in results["data_path"].values())
    assert all(positive(v) for v in results["startup"].values())


@pytest.mark.distributed
def test_every_row_measures_what_the_step_time_measurement_costs(bench):
    results, stdout, _ = bench
    for row in results["steps"]:
        # One round in quick mode: the median of the per-round costs is that round's.
        cost = row["template_step_ms"] / row["untimed_step_ms"] - 1
        assert row["step_time_cost"] == pytest.approx({"median": cost, "low": cost, "high": cost})
    assert results["worst_step_time_cost"] == max(row["step_time_cost"]["median"] for row in results["steps"])
    assert "step-time measurement (training.StepTime), cost per row: toy 2p " in stdout


def test_the_side_without_the_step_time_measurement_keeps_every_other_callback(tmp_path, monkeypatch, run_cli):
    from benchmarks import sides
    from benchmarks.workloads import WORKLOADS

    given = []
    monkeypatch.setattr(sides, "template_run", lambda *args, bound: given.append(args[7:]) or tmp_path)
    sides.untimed_run("toy", 1, 5, True, "cpu", tmp_path, "untimed", bound=60)
    configs = WORKLOADS["toy"].arguments(True, tmp_path / "cache", "cpu")
    cli = run_cli("fit", *configs, *given[0], *SINGLE_PROCESS, "--trainer.fast_dev_run=1", "--trainer.logger=false")
    kept = {type(callback).__name__ for callback in cli.trainer.callbacks}
    template = yaml.safe_load((REPO / "configs" / "ddp.yaml").read_text())["trainer"]["callbacks"]
    assert {entry["class_path"].rpartition(".")[2] for entry in template} - kept == {"StepTime"}


@pytest.mark.distributed
def test_prints_a_table_draws_a_chart_and_ends_with_the_headlines(bench):
    results, stdout, out = bench
    assert (results["accelerator"], results["torch"]) == ("cpu", torch.__version__) and results["device"]
    heading = f"cpu: {results['device']}, {results['cores']} CPU cores, torch {torch.__version__}"
    assert f"{heading}\nstep time, median ms     template Lightning    raw   template/raw (rounds)" in stdout
    for row in results["steps"]:
        assert f"{row['workload']:>8}, {row['processes']} process(es) {row['template_step_ms']:8.2f}" in stdout
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    *_, lightning, raw = stdout.strip().splitlines()
    for line, prefix, key in (
        (lightning, "worst template/Lightning step-time ratio: ", "worst_lightning_ratio"),
        (raw, "worst template/raw step-time ratio: ", "worst_ratio"),
    ):
        assert re.fullmatch(re.escape(prefix) + r"\d+\.\d\d", line), line
        assert float(line.removeprefix(prefix)) > 0
        assert line.endswith(f"{results[key]:.2f}")


def test_ratios_pair_the_runs_of_each_round():
    from benchmarks.comparisons import paired

    # Round 2 ran in a slow spell for both sides, round 3 in one for the template only: the median of the
    # per-round ratios puts both spells aside, the ratio of the medians (21 / 20) does not.
    template, raw = [20.0, 60.0, 21.0], [20.0, 60.0, 14.0]
    assert statistics.median(template) / statistics.median(raw) == 1.05
    assert paired(template, raw) == {"median": 1.0, "low": 1.0, "high": 1.5}


@pytest.mark.parametrize("rounds", ["0", "-1"])
def test_rounds_below_one_is_refused_naming_the_flag(rounds, monkeypatch, capsys):
    from benchmarks import bench

    monkeypatch.setattr(sys, "argv", ["bench", "--rounds", rounds])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    assert f"--rounds must be at least 1, got {rounds}" in capsys.readouterr().err


@pytest.mark.parametrize("accelerator", ["cpu", "gpu"])
def test_every_side_trains_on_the_accelerator_asked_for(accelerator, tmp_path, monkeypatch):
    from benchmarks.sides import module_command, template_command
    from benchmarks.workloads import run_arguments

    template = template_command("toy", 2, 5, True, accelerator, tmp_path, tmp_path / "template.json")
    assert [a for a in template if a.startswith(("--trainer.accelerator=", "--trainer.devices="))] == [
        f"--trainer.accelerator={accelerator}",
        "--trainer.devices=2",
    ]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for module in ("benchmarks.lightning_only", "benchmarks.raw_ddp"):
        command = module_command(module, "toy", 2, 5, True, accelerator, tmp_path, tmp_path / f"{module}.json")
        assert command[1:3] == ["-m", module]
        monkeypatch.setattr(sys, "argv", [module, *command[3:]])
        args = run_arguments(module)
        assert (args.accelerator, args.processes) == (accelerator, 2)


def test_the_raw_loop_runs_nccl_on_its_own_gpu_and_gloo_on_cpu():
    from benchmarks.raw_ddp import placement

    assert placement("gpu", 1) == ("nccl", torch.device("cuda", 1))
    assert placement("cpu", 1) == ("gloo", torch.device("cpu"))


@pytest.mark.parametrize(("gpus", "full", "quick"), [(1, (1,), (1,)), (4, (1, 2), (2,))])
def test_gpu_rows_have_at_most_one_process_per_gpu(gpus, full, quick, monkeypatch):
    from benchmarks.bench import process_counts

    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert process_counts(False, "gpu") == {"toy": full, "seq2seq": full}
    # Quick: the toy row is the one logging is measured on, with the most processes.
    assert process_counts(True, "gpu") == {"toy": quick, "seq2seq": (1,)}
    assert process_counts(False, "cpu") == {"toy": (1, 2), "seq2seq": (1, 2)}


def measured(results: dict):
    """The benchmark's measuring functions, returning ``results``' figures at once."""
    return {
        "compare_steps": lambda args, work: (results["steps"], results["logging"], [1.0]),
        "compare_data_path": lambda args: results["data_path"],
        "compare_startup": lambda args, work, first_steps: results["startup"],
    }


FIGURES = {
    "steps": [
        {
            "workload": "toy",
            "processes": 2,
            "template_step_ms": 3.0,
            "lightning_step_ms": 2.5,
            "raw_step_ms": 2.0,
            "ratio": {"median": 1.5, "low": 1.5, "high": 1.5},
            "lightning_over_raw": {"median": 1.25, "low": 1.25, "high": 1.25},
            "template_over_lightning": {"median": 1.2, "low": 1.2, "high": 1.2},
            "max_weight_difference": 0.0,
            "untimed_step_ms": 2.97,
            "step_time_cost": dict.fromkeys(("median", "low", "high"), 0.01),
            "run_s": {"template": 5.0, "lightning": 4.0, "raw": 3.0, "untimed": 5.0, "quiet": 5.0},
        }
    ],
    "logging": {
        "processes": 2,
        "default_step_ms": 3.0,
        "quiet_step_ms": 2.9,
        "cost": dict.fromkeys(("median", "low", "high"), 0.03),
    },
    "data_path": {"per_sample_us": 100.0, "whole_batch_us": 10.0, "speedup": 10.0},
    "startup": {"cli_help_s": 1.0, "import_lightning_s": 2.0, "ratio": 0.5, "first_step_s": 5.0},
}


def test_without_matplotlib_it_measures_prints_the_table_and_says_the_chart_was_skipped(tmp_path, monkeypatch, capsys):
    from benchmarks import bench

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where requirements-charts.txt is not installed
    for name, function in measured(FIGURES).items():
        monkeypatch.setattr(bench, name, function)
    monkeypatch.setattr(sys, "argv", ["bench", "--quick", "--out", str(tmp_path)])
    bench.main()
    out = capsys.readouterr().out
    results = json.loads((tmp_path / "bench.json").read_text())
    assert bench.table(results) in out
    assert (
        f"wrote {tmp_path / 'bench.json'}; skipped the chart bench.png, which needs matplotlib: pip install -r "
        "requirements-charts.txt\n" in out
    )
    assert out.endswith("worst template/Lightning step-time ratio: 1.20\nworst template/raw step-time ratio: 1.50\n")
    assert sorted(path.name for path in tmp_path.iterdir()) == ["bench.json"]


def test_a_side_that_does_not_finish_is_stopped_with_its_processes_and_named(tmp_path, monkeypatch, capsys):
    from benchmarks import bench, sides

    # A side that hangs, as the raw loop's two processes did at exit, with a process of its own that hangs too.
    hang = tmp_path / "hang.sh"
    hang.write_text(f"sleep infinity &\necho $! >{tmp_path / 'child'}\necho started\nwait\n")

    def compare_steps(args, work):
        sides.run(["bash", str(hang)], work / "raw-toy-2-0", bound=args.side_timeout)

    monkeypatch.setattr(bench, "compare_steps", compare_steps)
    monkeypatch.setattr(sys, "argv", ["bench", "--quick", "--out", str(tmp_path / "out"), "--side-timeout", "3"])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == (
        "error: bash hang.sh (run raw-toy-2-0) did not finish within 3 s (--side-timeout) and was stopped, with every "
        f"process it started. Its output is above. Nothing was written to {tmp_path / 'out'}."
    )
    assert capsys.readouterr().err.strip() == "started"
    stat = Path(f"/proc/{(tmp_path / 'child').read_text().strip()}/stat")

    def ended() -> bool:  # gone, or dead and not yet reaped by init (state Z)
        try:
            return stat.read_text().rpartition(")")[2].split()[0] == "Z"
        except FileNotFoundError:
            return True

    # SIGKILL was sent; a loaded machine may take a moment to carry it out.
    deadline = time.monotonic() + 30
    while not ended() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ended(), "the side's process outlived it"
    assert list((tmp_path / "out").iterdir()) == []


def test_gpu_without_cuda_stops_with_one_line_naming_the_flag(tmp_path, monkeypatch, capsys):
    from benchmarks import bench

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(sys, "argv", ["bench", "--accelerator", "gpu", "--quick", "--out", str(tmp_path)])
    with pytest.raises(SystemExit) as exit_:
        bench.main()
    assert exit_.value.code == 2
    *_, error = capsys.readouterr().err.strip().splitlines()
    assert error.startswith("python -m benchmarks.bench: error: --accelerator gpu needs a CUDA GPU, and torch ")
    assert "finds none" in error and error.endswith("run it on a GPU machine, or leave --accelerator at cpu")
    assert list(tmp_path.iterdir()) == []


def test_more_processes_than_gpus_is_refused_before_anything_starts(monkeypatch, capsys):
    from benchmarks.workloads import run_arguments

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    command = ["--workload", "toy", "--processes", "2", "--steps", "5", "--out", "raw.json", "--accelerator", "gpu"]
    monkeypatch.setattr(sys, "argv", ["raw_ddp", *command])
    with pytest.raises(SystemExit) as exit_:
        run_arguments("raw loop")
    assert exit_.value.code == 2
    assert "--processes 2 with --accelerator gpu needs 2 GPUs, one per process, and this machine has 1" in (
        capsys.readouterr().err
    )


@pytest.mark.distributed
@needs_gpus(1)
def test_on_gpus_every_side_is_timed_and_the_results_name_the_gpu(tmp_path):
    command = [sys.executable, "-m", "benchmarks.bench", "--quick", "--accelerator", "gpu", "--out", str(tmp_path)]
    result = run_script(command, cwd=REPO, env=with_charts(), timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    results = json.loads((tmp_path / "bench.json").read_text())
    device = torch.cuda.get_device_name(0)
    assert (results["accelerator"], results["device"], results["torch"]) == ("gpu", device, torch.__version__)
    most = min(2, torch.cuda.device_count())
    assert sorted((r["workload"], r["processes"]) for r in results["steps"]) == [("seq2seq", 1), ("toy", most)]
    for row in results["steps"]:
        assert all(positive(row[f"{side}_step_ms"]) for side in SIDES), row
    assert f"gpu: {device}, {results['cores']} CPU cores, torch {torch.__version__}" in result.stdout
    assert (tmp_path / "bench.png").read_bytes().startswith(b"\x89PNG")


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_the_overhead_benchmark_prints_each_sides_step_and_what_each_layer_and_callback_adds(
    clock, tmp_path, monkeypatch, capsys
):
    from benchmarks import overhead

    # Each run steps evenly, the template 10 us slower in the second round: every figure is known to the microsecond.
    step_us = {
        "raw": 500,
        "lightning": 1300,
        "lightning+logger": 1380,
        "template": 1450,
        "without StepTime": 1420,
        "without logger": 1400,
    }
    modules = {"benchmarks.raw_ddp": "raw", "benchmarks.lightning_only": "lightning"}
    flags = {
        ("--turn_off=[StepTime]",): "without StepTime",
        ("--trainer.logger=false",): "without logger",
        (): "template",
    }
    runs = []

    def record(side: str, args: tuple) -> Path:
        workload, processes, steps, quick, accelerator, work, name, *given = args
        runs.append((side, workload, processes, accelerator))
        step = step_us[side] + (10 if side == "template" and name.endswith("-1") else 0)
        path = tmp_path / f"{name}.json"
        starts = [i * step / 1e6 for i in range(steps)]
        path.write_text(json.dumps({"starts": starts if clock == "wall" else [], "cpu_starts": starts}))
        return path

    def module_run(module: str, *args, bound: float) -> Path:
        return record(modules[module] + ("+logger" if args[7:] == ("--logged",) else ""), args[:7])

    monkeypatch.setattr(overhead, "module_run", module_run)
    monkeypatch.setattr(overhead, "template_run", lambda *args, bound: record(flags[tuple(args[7:])], args))
    only = ["--only", "StepTime,logger", "--clock", clock]
    monkeypatch.setattr(sys, "argv", ["overhead", "--rounds", "2", "--steps", "20", *only])
    overhead.main()
    assert sorted(runs) == sorted((side, "null", 1, "cpu") for side in step_us for _ in range(2))
    assert capsys.readouterr().out.splitlines()[-12:] == [
        f"per-step cost{' in CPU time' if clock == 'cpu' else ''} on a workload of almost no compute, 1 CPU process, "
        "median of 2 rounds:",
        "  raw                                 500.0 us/step",
        "  lightning                          1300.0 us/step",
        "  lightning+logger                   1380.0 us/step",
        "  template                           1455.0 us/step",
        "  without StepTime                   1420.0 us/step",
        "  without logger                     1400.0 us/step",
        "  Lightning over the raw loop       +800.0 us (+800.0 to +800.0)",
        "  template over Lightning           +155.0 us (+150.0 to +160.0)",
        "  the same, Lightning logging too    +75.0 us (+70.0 to +80.0)",
        "  StepTime                           +35.0 us (+30.0 to +40.0)",
        "  logger                             +55.0 us (+50.0 to +60.0)",
    ]


def test_the_overhead_benchmark_refuses_a_callback_the_template_does_not_have():
    result = run_script([sys.executable, "-m", "benchmarks.overhead", "--only", "StepTim"], cwd=REPO)
    assert result.returncode == 2
    assert "error: --only names StepTim; the template has ModelCheckpoint, LastCheckpoint, FiniteLoss," in result.stderr
