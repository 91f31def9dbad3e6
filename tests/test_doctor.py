"""scripts/doctor.sh on two nodes over loopback, the collectives it verifies, and its bandwidth benchmark."""

import csv
import json
import re
import subprocess

import pytest
import torch
import torch.distributed as dist
from torch.distributed import HashStore

from scripts.doctor import check_collectives
from tests.helpers import copy_project, free_port, launcher_env

COLLECTIVES = ("broadcast", "scatter", "gather", "reduce", "all_gather", "all_reduce", "send/recv")


def doctor(node, gpus: str, rank: int, *extra: str, **settings: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(node / "scripts" / "doctor.sh"), gpus, str(rank), *extra],
        env=launcher_env(**settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_nodes(root, gpus: str, worker_extra: tuple[str, ...] = (), **settings: str) -> list[tuple[int, str]]:
    nodes = [copy_project(root / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "2", "DOCTOR_TIMEOUT": "120", **settings}
    worker = doctor(nodes[1], gpus, 1, *worker_extra, **settings)
    master = doctor(nodes[0], gpus, 0, **settings)
    return [(p.wait(timeout=600), p.stdout.read()) for p in (master, worker)]


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Two healthy nodes of 2 processes each, with the bandwidth benchmark up to 1 MiB messages."""
    root = tmp_path_factory.mktemp("doctor")
    return root, two_nodes(root, "cpu:2", BENCH="1", BENCH_MAX_MB="1")


@pytest.mark.distributed
def test_two_healthy_nodes_pass_with_a_row_per_process(healthy):
    _, ((master_status, master), (worker_status, worker)) = healthy
    assert master_status == 0, master
    assert worker_status == 0, worker
    rows = re.findall(r"^(\d)\s+\S+\s+(\d)\s+(\d)\s+cpu\s+[\d.]+\s+\S+\s+\S+\s+(\w{12})\s+(\w{12})$", master, re.M)
    assert [row[:3] for row in rows] == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert len({row[3:] for row in rows}) == 1, "all processes should show the same code and config"
    for output in (master, worker):
        assert "ok    all 4 processes of 2 node(s) joined and agree on versions, code and config" in output
        for name in COLLECTIVES:
            assert f"ok    {name} on 4 processes (gloo)" in output
        assert output.rstrip().endswith("ok    the doctor found nothing wrong")


@pytest.mark.distributed
def test_nodes_with_different_configs_fail_naming_the_difference(tmp_path):
    # One process per node: the table's row per process is checked with two per node above.
    (master_status, master), (worker_status, worker) = two_nodes(tmp_path, "cpu:1", ("--trainer.max_epochs=3",))
    assert master_status != 0 and worker_status != 0
    configs = re.findall(r"^\d\s+.*\s(\w{12})$", master, re.M)
    assert len(configs) == 2 and configs[0] != configs[1]
    for output in (master, worker):
        assert "config differs between node 0 (" in output and "trainer.max_epochs (5 vs 3)" in output
        assert "FAIL  the doctor found problems above" in output
        assert "broadcast on" not in output, "no collectives with nodes that disagree"


@pytest.mark.distributed
def test_benchmark_writes_a_table_csv_json_and_plot(healthy):
    root, ((status, output), _) = healthy
    assert status == 0, output
    out_dir = root / "node0" / "logs" / "nodes" / "doctor"
    with open(out_dir / "comm_bench.csv") as file:
        rows = list(csv.DictReader(file))
    assert rows == [
        {k: str(v) for k, v in row.items()} for row in json.loads((out_dir / "comm_bench.json").read_text())["rows"]
    ]
    assert {row["operation"] for row in rows} == {"all_reduce", "all_gather", "broadcast"}
    for operation in ("all_reduce", "all_gather", "broadcast"):
        sizes = [int(row["bytes"]) for row in rows if row["operation"] == operation]
        assert sizes == sorted(set(sizes)) and sizes[0] >= 1000 and sizes[-1] <= 1 << 20
    processes = 4
    factors = {"all_reduce": 2 * (processes - 1) / processes, "all_gather": (processes - 1) / processes, "broadcast": 1}
    for row in rows:
        algbw, busbw = float(row["algbw_GBps"]), float(row["busbw_GBps"])
        assert float(row["time_us"]) > 0 and algbw > 0 and busbw > 0
        assert busbw == pytest.approx(algbw * factors[row["operation"]])
    assert (out_dir / "comm_bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert re.search(r"^all_reduce\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", output, re.M)
    assert not (root / "node1" / "logs" / "nodes" / "doctor").exists(), "a worker wrote benchmark files"


def test_a_collective_with_a_wrong_result_is_reported(monkeypatch):
    dist.init_process_group("gloo", store=HashStore(), rank=0, world_size=1)
    try:
        real_all_reduce = dist.all_reduce

        def off_by_one(tensor, *args, **kwargs):
            real_all_reduce(tensor, *args, **kwargs)
            tensor.add_(1)

        monkeypatch.setattr(dist, "all_reduce", off_by_one)
        problems = check_collectives(0, 1, torch.device("cpu"))
    finally:
        dist.destroy_process_group()
    assert problems["all_reduce"] == "rank 0 got [2.0, 2.0, 2.0], expected 1.0"
    assert {name: text for name, text in problems.items() if name != "all_reduce"} == dict.fromkeys(
        ["broadcast", "scatter", "gather", "reduce", "all_gather"], ""
    )
