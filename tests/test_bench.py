"""benchmarks/bench.py in its quick mode: every figure measured, written as JSON and drawn, same results."""

import json
import math
import re
import statistics

import pytest

from tests.helpers import REPO, run_script


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = run_script([str(REPO / "benchmarks" / "bench.py"), "--quick", "--out", str(out)], cwd=out, timeout=1800)
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
def test_prints_a_table_draws_a_chart_and_ends_with_the_headline(bench):
    results, stdout, out = bench
    assert "step time, median ms     template Lightning    raw   template/raw (rounds)" in stdout
    for row in results["steps"]:
        assert f"{row['workload']:>8}, {row['processes']} process(es) {row['template_step_ms']:8.2f}" in stdout
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"worst template/raw step-time ratio: \d+\.\d\d", last)
    assert last.endswith(f"{results['worst_ratio']:.2f}")


def test_ratios_pair_the_runs_of_each_round():
    from benchmarks.bench import paired

    # Round 2 ran in a slow spell for both sides, round 3 in one for the template only: the median of the
    # per-round ratios puts both spells aside, the ratio of the medians (21 / 20) does not.
    template, raw = [20.0, 60.0, 21.0], [20.0, 60.0, 14.0]
    assert statistics.median(template) / statistics.median(raw) == 1.05
    assert paired(template, raw) == {"median": 1.0, "low": 1.0, "high": 1.5}
