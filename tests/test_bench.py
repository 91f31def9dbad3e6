"""benchmarks/bench.py in its quick mode: every figure measured, written as JSON and drawn, same results."""

import json
import math
import re

import pytest

from tests.conftest import REPO, run_script

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    result = run_script([str(REPO / "benchmarks" / "bench.py"), "--quick", "--out", str(out)], cwd=out, timeout=900)
    assert result.returncode == 0, result.stdout + result.stderr
    return json.loads((out / "bench.json").read_text()), result.stdout, out


def positive(value) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


def test_every_workload_and_process_count_is_timed_against_the_raw_loop(bench):
    results, _, _ = bench
    rows = results["steps"]
    assert sorted((r["workload"], r["processes"]) for r in rows) == [
        ("seq2seq", 1),
        ("seq2seq", 2),
        ("toy", 1),
        ("toy", 2),
    ]
    for row in rows:
        assert positive(row["template_step_ms"]) and positive(row["raw_step_ms"]), row
        assert row["ratio"] == pytest.approx(row["template_step_ms"] / row["raw_step_ms"])
    assert results["worst_ratio"] == max(r["ratio"] for r in rows)


def test_template_and_raw_loop_end_with_the_same_weights(bench):
    results, _, _ = bench
    for row in results["steps"]:
        assert row["max_weight_difference"] <= 1e-6, row


def test_logging_data_path_and_startup_figures_are_present(bench):
    results, _, _ = bench
    assert all(positive(results["logging"][k]) for k in ("default_step_ms", "quiet_step_ms"))
    assert results["logging"]["cost"] == pytest.approx(
        results["logging"]["default_step_ms"] / results["logging"]["quiet_step_ms"] - 1
    )
    assert all(positive(v) for v in results["data_path"].values())
    assert all(positive(v) for v in results["startup"].values())


def test_prints_a_table_draws_a_chart_and_ends_with_the_headline(bench):
    results, stdout, out = bench
    assert "step time (median ms)" in stdout
    assert (out / "bench.png").read_bytes().startswith(b"\x89PNG")
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"worst template/raw step-time ratio: \d+\.\d\d", last)
    assert last.endswith(f"{results['worst_ratio']:.2f}")
