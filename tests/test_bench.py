"""``python -m benchmarks.bench --quick``: every figure measured, written as JSON and drawn, same results."""

import json
import math
import re
import statistics
import sys

import pytest

from tests.helpers import REPO, run_script


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    command = [sys.executable, "-m", "benchmarks.bench", "--quick", "--out", str(out)]
    result = run_script(command, cwd=REPO, timeout=1800)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "bench.json").read_text()), result.stdout, out


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


@pytest.mark.distributed
def test_every_workload_and_process_count_is_timed_against_the_raw_loop(bench):
    results, _, _ = bench
    rows = results["steps"]
    assert sorted((r["workload"], r["processes"]) for r in rows) == [("seq2seq", 1), ("toy", 2)]
    for row in rows:
        rounds = row["rounds_step_ms"]
        for side in ("template", "lightning", "raw"):
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
    assert all(positive(results["logging"][k]) for k in ("default_step_ms", "quiet_step_ms"))
    # One round in quick mode: the median of the per-round costs is that round's.
    cost = results["logging"]["default_step_ms"] / results["logging"]["quiet_step_ms"] - 1
    assert results["logging"]["cost"] == pytest.approx({"median": cost, "low": cost, "high": cost})
    assert all(positive(v) for v in results["data_path"].values())
    assert all(positive(v) for v in results["startup"].values())


@pytest.mark.distributed
def test_prints_a_table_draws_a_chart_and_ends_with_the_headlines(bench):
    results, stdout, out = bench
    assert "step time, median ms     template Lightning    raw   template/raw (rounds)" in stdout
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
    from benchmarks.bench import paired

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
