"""scripts/gpu_tier.py, the whole GPU check in one command or in parts (--only), where there is no GPU: what it would
install from a folder of wheels and run, for every part or those named, its refusals (no folder, a pin neither
installed nor carried, no GPU, a part it does not know) and its summary's lines."""

import re
import sys
from pathlib import Path

import pytest
import torch

from scripts import gpu_tier
from tests.helpers import REPO

FILL = "fill it as DEVELOPERS.md says (A GPU machine without internet), on a machine with internet"


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    monkeypatch.setattr(sys, "argv", ["gpu_tier", *args])
    try:
        status = gpu_tier.main()
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def lacking(*projects: str):
    """installed_version as on a machine that has every pin but ``projects``."""
    return lambda project: None if gpu_tier.normalized(project) in projects else "1.0"


def wheels(directory: Path, *names: str) -> Path:
    directory.mkdir()
    for name in names:
        (directory / name).touch()
    return directory


def test_without_the_wheels_folder_it_stops_saying_how_to_fill_it(monkeypatch, capsys, tmp_path):
    status, out, err = run(monkeypatch, capsys, str(tmp_path / "wheels"))
    assert (status, out) == (2, "")
    assert err == f"error: the wheels folder {tmp_path / 'wheels'} does not exist: {FILL}, and copy it here.\n"


def test_a_pin_neither_installed_nor_carried_is_named_before_anything_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_tier, "installed_version", lacking("omegaconf", "pytest-timeout"))
    folder = wheels(tmp_path / "wheels", "omegaconf-2.4.0-py3-none-any.whl")
    status, out, err = run(monkeypatch, capsys, str(folder), "--dry-run")
    assert (status, out) == (2, "")
    assert err == (
        f"error: this Python ({sys.executable}) lacks pytest-timeout==2.4.0, and {folder} has no wheel of it: "
        f"{FILL}, with these pins too.\n"
    )


def test_the_dry_run_installs_only_what_this_python_lacks_and_names_every_step(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_tier, "installed_version", lacking("omegaconf", "docstring-parser"))
    carried = ["omegaconf-2.4.0-py3-none-any.whl", "docstring_parser-0.18.0-py3-none-any.whl"]
    folder = wheels(tmp_path / "wheels", *carried, "six-1.17.0-py2.py3-none-any.whl")
    status, out, err = run(monkeypatch, capsys, str(folder), "--dry-run", "--out", str(tmp_path / "out"))
    assert (status, err) == (0, "")
    install, tier, tools, main, bench = out.splitlines()
    assert install == (
        f"would install: {sys.executable} -m pip install --no-index --no-deps "
        f"{folder / carried[1]} {folder / carried[0]}"
    )
    pytest_gpu = f"{sys.executable} -m pytest -m gpu -n 0 -v -rA -p no:cacheprovider"
    assert tier == f"would run (GPU tier, training): {pytest_gpu} {' '.join(halves()['tier'])}"
    assert tools == f"would run (GPU tier, doctor and benchmarks): {pytest_gpu} {' '.join(halves()['tools'])}"
    assert main.startswith("would run (main command): RUN_ID=gpu-tier-")
    assert main.endswith(f"LOG_DIR={tmp_path / 'out' / 'nodes'} ./scripts/run_ddp_train.sh 0 0")
    assert bench.endswith(f"-m benchmarks.bench --short --accelerator gpu --out {tmp_path / 'out' / 'bench'}")
    assert not (tmp_path / "out").exists(), "the dry run wrote something"


def halves() -> dict[str, list[str]]:
    return {half: [f"tests/{name}" for name in files] for half, files in gpu_tier.TIER_FILES.items()}


def test_the_two_halves_of_the_tier_hold_every_gpu_test_file_once():
    marked = sorted(
        str(path.relative_to(REPO))
        for path in REPO.glob("tests/*.py")
        if re.search(r"^@needs_gpus\(", path.read_text(), re.M)
    )
    assert sorted(halves()["tier"] + halves()["tools"]) == marked


def planned(out: str) -> tuple[list[str], list[str]]:
    """The wheels the dry run would install and the names of the steps it would run, in order."""
    install, *runs = out.splitlines()
    return [word for word in install.split() if word.endswith(".whl")], [
        re.match(r"would run \((.+?)\): ", line)[1] for line in runs
    ]


def test_only_main_plans_the_main_command_with_its_own_wheels_only(monkeypatch, capsys, tmp_path):
    # pytest-timeout, the tier's, has no wheel: a part that does not need it runs without it.
    monkeypatch.setattr(gpu_tier, "installed_version", lacking("omegaconf", "matplotlib", "pytest-timeout"))
    carried = ["omegaconf-2.4.0-py3-none-any.whl", "matplotlib-3.11.2-cp311-cp311-manylinux2014_x86_64.whl"]
    folder = wheels(tmp_path / "wheels", *carried)
    status, out, err = run(monkeypatch, capsys, str(folder), "--dry-run", "--only", "main")
    assert (status, err) == (0, "")
    installed, steps = planned(out)
    assert installed == [str(folder / carried[0])], "only requirements.txt's wheel goes in"
    assert steps == [gpu_tier.PARTS["main"]]


def test_only_tier_and_bench_plan_those_two_in_order_with_their_wheels(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_tier, "installed_version", lacking("omegaconf", "matplotlib", "pytest-timeout"))
    carried = [
        "matplotlib-3.11.2-cp311-cp311-manylinux2014_x86_64.whl",
        "omegaconf-2.4.0-py3-none-any.whl",
        "pytest_timeout-2.4.0-py3-none-any.whl",
    ]
    folder = wheels(tmp_path / "wheels", *carried)
    status, out, err = run(monkeypatch, capsys, str(folder), "--dry-run", "--only", "bench", "--only", "tier")
    assert (status, err) == (0, "")
    installed, steps = planned(out)
    assert installed == [str(folder / wheel) for wheel in carried]
    assert steps == [gpu_tier.PARTS["tier"], gpu_tier.PARTS["bench"]]


def test_a_part_it_does_not_know_stops_it_naming_the_parts_it_does(monkeypatch, capsys, tmp_path):
    status, out, err = run(monkeypatch, capsys, str(tmp_path), "--dry-run", "--only", "train")
    assert (status, out) == (2, "")
    error = err.splitlines()[-1]
    assert error.startswith("gpu_tier: error: argument --only: invalid choice: 'train' (choose from ")
    assert re.findall(r"\w+", error.split("(choose from ")[1]) == list(gpu_tier.PARTS)


def test_the_summary_says_which_steps_this_call_did_not_run():
    failed = "FAILED tests/test_gpu.py::test_resume - AssertionError"
    tier = f"{failed}\n== 1 failed, 9 passed in 200.40s ==\n"
    tools = "== 3 passed in 100.00s ==\n"
    took = "short mode: took 290 s from start to end, within its budget of 300 s"
    results = {"tier": (1, tier, 200.4), "tools": (0, tools, 100.2), "bench": (0, f"x\n{took}\n", 291.2)}
    assert gpu_tier.step_lines(results) == [
        "GPU tier, training: 9 passed, 1 failed, 0 errors, 0 skipped (200 s)",
        f"  {failed}",
        "GPU tier, doctor and benchmarks: 3 passed, 0 failed, 0 errors, 0 skipped (100 s)",
        "main command: not run in this call",
        "benchmark: ok (291 s)",
        f"  {took}",
    ]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU runs the check")
def test_without_a_gpu_it_stops_before_installing_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_tier, "installed_version", lacking("omegaconf"))
    folder = wheels(tmp_path / "wheels", "omegaconf-2.4.0-py3-none-any.whl")
    status, out, err = run(monkeypatch, capsys, str(folder), "--out", str(tmp_path / "out"))
    assert (status, out) == (2, "")
    assert err.startswith(f"error: torch {torch.__version__} sees no CUDA GPU here (CUDA build: ")
    assert err.endswith("On CPU, run README's test command; here, --dry-run shows the steps.\n")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("output", "counts"),
    [
        (
            "x\n===== 4 failed, 10 passed, 2 skipped in 222.31s (0:03:42) =====\n",
            "10 passed, 4 failed, 0 errors, 2 skipped",
        ),
        ("== 1 failed, 3 passed, 1 error in 9.01s ==", "3 passed, 1 failed, 1 errors, 0 skipped"),
        ("ImportError while loading conftest", "0 passed, 0 failed, 0 errors, 0 skipped"),
    ],
    ids=["the issue's run", "an error", "no summary"],
)
def test_the_summary_counts_what_pytest_counted(output, counts):
    assert gpu_tier.test_counts(output) == counts


def test_the_summary_keeps_the_benchmarks_goal_ratios_headlines_and_warning_over_budget():
    output = (
        "short mode: 50 runs in 5 rounds, about 258 s on one H100 by the estimate of benchmarks/short.py; "
        "budget 300 s\n"
        "  template/Lightning: toy 1p 1.012 (0.994-1.031), seq2seq 1p 1.004 (0.990-1.020)\n"
        "  Lightning/raw: toy 1p 1.312 (1.290-1.330), seq2seq 1p 1.104 (1.090-1.120)\n"
        "step-time measurement (training.StepTime), cost per row: toy 1p +0.5% (-0.2% to +1.1%), seq2seq 1p +0.1% "
        "(-0.3% to +0.4%)\n"
        "warning: the short mode took 341 s from start to end, over its budget of 300 s (5 minutes on one H100 for 5 "
        "rounds); the runs line above says which sides' launches took the time\n"
        "worst template/Lightning step-time ratio: 1.01\nworst template/raw step-time ratio: 1.40\n"
    )
    lines = output.splitlines()
    assert gpu_tier.bench_headlines(output) == [lines[1].strip(), *lines[3:]]


def test_a_steps_log_gives_every_line_its_seconds_and_the_summary_reads_the_plain_output(tmp_path, capsys):
    command = [sys.executable, "-c", "print('collected 2 items'); print('== 2 passed in 1.00s ==')"]
    status, output, _ = gpu_tier.run_step("GPU tier, training", command, {}, tmp_path)
    assert (status, output) == (0, "collected 2 items\n== 2 passed in 1.00s ==\n")
    assert capsys.readouterr().out.endswith(output)
    logged = (tmp_path / "gpu_tier_training.log").read_text().splitlines()
    assert [re.fullmatch(r"\s*\d+ s \| (.*)", line)[1] for line in logged] == output.splitlines()
