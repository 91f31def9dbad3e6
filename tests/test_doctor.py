"""scripts/doctor.sh on two nodes over loopback and on GPUs, the collectives it verifies, and its bandwidth
benchmark."""

import csv
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from scripts import comm_bench, cpu_check
from scripts.collective_check import check_collectives, ring
from scripts.doctor import COLLECTIVE_TIMEOUT
from scripts.doctor import main as doctor_main
from tests.helpers import DDP_YAML, charts_path, copy_project, free_port, launcher_env, needs_gpus

COLLECTIVES = ("broadcast", "scatter", "gather", "reduce", "all_gather", "all_reduce", "send/recv")
CORES = len(os.sched_getaffinity(0))


def doctor(node, gpus: str, rank: int, *extra: str, **settings: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(node / "scripts" / "doctor.sh"), gpus, str(rank), *extra],
        env=launcher_env(**settings),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def two_nodes(
    root, gpus: str, worker_extra: tuple[str, ...] = (), worker_settings: dict[str, str] | None = None, **settings: str
) -> list[tuple[int, str]]:
    nodes = [copy_project(root / f"node{rank}") for rank in range(2)]
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "2", "DOCTOR_TIMEOUT": "120", **settings}
    worker = doctor(nodes[1], gpus, 1, *worker_extra, **settings, **(worker_settings or {}))
    master = doctor(nodes[0], gpus, 0, **settings)
    return [(p.wait(timeout=600), p.stdout.read()) for p in (master, worker)]


def one_node(root, gpus: str) -> tuple[str, list[dict[str, str]]]:
    """A healthy run of the doctor with the benchmark on one node: its output and the benchmark's rows."""
    node = copy_project(root / "node0")
    settings = {"MASTER_PORT": str(free_port()), "NUM_NODES": "1", "PYTHONPATH": charts_path()}
    process = doctor(node, gpus, 0, BENCH="1", BENCH_MAX_MB="1", **settings)
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output
    assert output.rstrip().endswith("ok    the doctor found nothing wrong"), output
    with open(node / "logs" / "nodes" / "doctor" / "comm_bench.csv") as file:
        return output, list(csv.DictReader(file))


@pytest.fixture(scope="module")
def healthy(tmp_path_factory):
    """Two healthy nodes of 2 processes each, with the bandwidth benchmark up to 1 MiB messages; the worker's
    processes run a thread per core of the machine each, so between them more threads than it has cores."""
    root = tmp_path_factory.mktemp("doctor")
    oversubscribed = {"OMP_NUM_THREADS": str(CORES)}
    bench = {"BENCH": "1", "BENCH_MAX_MB": "1", "PYTHONPATH": charts_path()}  # the master plots with matplotlib
    return root, two_nodes(root, "cpu:2", worker_settings=oversubscribed, **bench)


@pytest.mark.distributed
def test_two_healthy_nodes_pass_with_a_row_per_process(healthy):
    _, ((master_status, master), (worker_status, worker)) = healthy
    assert master_status == 0, master
    assert worker_status == 0, worker
    row = r"^(\d)\s+\S+\s+(\d)\s+(\d)\s+cpu\s+(\S+)\s+(\d+)\s+[\d.]+\s+\S+\s+\S+\s+(\w{12})\s+(\w{12})$"
    rows = re.findall(row, master, re.M)
    assert [row[:3] for row in rows] == [("0", "0", "0"), ("1", "0", "1"), ("2", "1", "0"), ("3", "1", "1")]
    assert len({row[5:] for row in rows}) == 1, "all processes should show the same code and config"
    # Each process's usable cores (all of this machine's, nothing binds them) and threads: by default the
    # node's cores shared among its 2 processes, as in training; on the worker, OMP_NUM_THREADS.
    assert {row[3] for row in rows} == {cpu_check.ranges(sorted(os.sched_getaffinity(0)))}
    assert [int(row[4]) for row in rows] == [max(1, CORES // 2)] * 2 + [CORES] * 2
    for output in (master, worker):
        assert "ok    all 4 processes of 2 node(s) joined and agree on versions, code and config" in output
        for name in COLLECTIVES:
            assert f"ok    {name} on 4 processes (gloo)" in output
    assert "WARN" not in master
    assert master.rstrip().endswith("ok    the doctor found nothing wrong")
    # A note, not a failure, on a Python whose forks can hang (training/job/versions.py's known_bugs).
    assert ("note  Python 3.11." in master and "gh-112275" in master) == (sys.version_info < (3, 11, 10))


@pytest.mark.distributed
def test_a_node_with_more_threads_than_cores_is_warned_about_and_passes(healthy):
    _, (_, (worker_status, worker)) = healthy
    assert worker_status == 0, worker
    cores = cpu_check.ranges(sorted(os.sched_getaffinity(0)))
    warning = f"WARN  the 2 processes on node 1 ({socket.gethostname()}) run {2 * CORES} threads in all on the "
    assert f"{warning}{CORES} core(s) they may use ({cores})" in worker, worker
    assert worker.rstrip().endswith("ok    the doctor found nothing that stops training, but see the warnings above")


@pytest.mark.parametrize(
    ("processes", "expected"),
    [
        ([{"rank": 0, "cores": [0, 1], "threads": 1}, {"rank": 1, "cores": [0, 1], "threads": 1}], []),
        # srun bound each task to its own cores: 2 threads each on 2 cores of their own
        ([{"rank": 0, "cores": [0, 1], "threads": 2}, {"rank": 1, "cores": [2, 3], "threads": 2}], []),
        (
            [{"rank": 2, "cores": [0, 1, 2, 3, 8], "threads": 8}],
            [
                "rank 2 on node 1 (b) runs 8 threads on 5 usable core(s) (0-3,8): set OMP_NUM_THREADS to at most 5, "
                "or give the process more cores (under SLURM, --cpus-per-task, which srun must be given too)"
            ],
        ),
        (
            [{"rank": 0, "cores": [0, 1, 2, 3], "threads": 4}, {"rank": 1, "cores": [0, 1, 2, 3], "threads": 4}],
            [
                "the 2 processes on node 1 (b) run 8 threads in all on the 4 core(s) they may use (0-3): set "
                "OMP_NUM_THREADS to at most 2, or unset it (each process then takes its share)"
            ],
        ),
    ],
    ids=["shared fairly", "bound apart", "more threads than its cores", "more threads than the node's cores"],
)
def test_threads_beyond_the_usable_cores_are_named_with_the_fix(processes, expected):
    assert cpu_check.warnings("node 1 (b)", processes) == expected


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


def stopped_doctor(monkeypatch, tmp_path, *options: str, node_rank: int = 0, cli_args: tuple[str, ...] = ()) -> int:
    """scripts.doctor's main in this process, as scripts/doctor.sh starts it on a node of one CPU process, when it
    stops before any process joins: its exit status."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NODE_RANK", str(node_rank))  # scripts/doctor.sh exports it, as the launcher does
    args = ["--node-rank", str(node_rank), "--nproc", "1", "--accelerator", "cpu", "--gpus", "cpu:1"]
    args += ["--timeout", "1", "--out-dir", "out", *options]
    cli = ["fit", "-c", DDP_YAML, "--trainer.accelerator=cpu", "--trainer.devices=1", *cli_args]
    monkeypatch.setattr(sys, "argv", ["doctor", *args, "--", *cli])
    with pytest.raises(SystemExit) as exit_:
        doctor_main()
    return exit_.value.code


def test_bench_without_matplotlib_on_the_master_stops_before_the_processes_join(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where requirements-charts.txt is not installed
    assert stopped_doctor(monkeypatch, tmp_path, "--bench") == 2
    assert capsys.readouterr().out == (
        "ok    node 0 of 1: 1 process(es) (cpu:1), config parsed\n"
        "FAIL  BENCH=1: the master plots comm_bench.png with matplotlib, which is not installed here: "
        "pip install -r requirements-charts.txt, or leave BENCH unset. Nothing was measured.\n"
    )


def test_a_config_that_does_not_parse_stops_the_doctor_naming_the_mistake_and_the_command(
    monkeypatch, capsys, tmp_path
):
    assert stopped_doctor(monkeypatch, tmp_path, cli_args=("--trainer.bogus=3",)) == 2
    out, err = capsys.readouterr()
    assert "error: unrecognized arguments: --trainer.bogus=3" in err and "Traceback" not in err
    assert "cli.py fit --help" in err, "the tip names the command training runs, not the doctor"
    assert out == (
        f"FAIL  the config above does not parse (cli.py fit -c {DDP_YAML} --trainer.accelerator=cpu "
        "--trainer.devices=1 --trainer.bogus=3). Nothing was joined.\n"
    )


def test_a_node_rank_beyond_the_configs_nodes_stops_the_doctor_as_it_stops_training(monkeypatch, capsys, tmp_path):
    assert stopped_doctor(monkeypatch, tmp_path, node_rank=1) == 2
    assert capsys.readouterr().out.startswith(
        "FAIL  NODE_RANK=1 is out of range: the config has trainer.num_nodes=1, so node ranks are 0..0."
    )


@pytest.mark.distributed
def test_bench_without_matplotlib_on_the_master_stops_the_workers_at_once_naming_it(tmp_path):
    # Nothing puts matplotlib on the master's path. The worker starts first, as it waits for the master.
    settings = {"BENCH": "1", "CONNECT_TIMEOUT": "120"}
    (master_status, master), (worker_status, worker) = two_nodes(tmp_path, "cpu:1", **settings)
    assert master_status == 2, master
    assert "FAIL  BENCH=1: the master plots comm_bench.png with matplotlib, which is not installed here" in master
    assert "telling the 1 processes of the other nodes" in master
    assert worker_status == 1, worker
    *_, stopped, verdict = worker.strip().splitlines()
    assert stopped == (
        "FAIL  node 0 stopped the doctor before the processes joined: BENCH=1: the master plots comm_bench.png with "
        f"matplotlib, which is not installed on node 0 ({socket.gethostname()}): pip install -r "
        "requirements-charts.txt there, or leave BENCH unset on every node."
    ), worker
    assert verdict == "FAIL  the doctor found problems above"
    assert "cannot reach the master" not in worker and "no word from global rank 0" not in worker


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


def test_a_collective_with_a_wrong_result_is_reported(process_group_alone, monkeypatch):
    real_all_reduce = dist.all_reduce

    def off_by_one(tensor, *args, **kwargs):
        real_all_reduce(tensor, *args, **kwargs)
        tensor.add_(1)

    monkeypatch.setattr(dist, "all_reduce", off_by_one)
    problems = check_collectives(0, 1, torch.device("cpu"))
    assert problems["all_reduce"] == "rank 0 got [2.0, 2.0, 2.0], expected 1.0"
    assert {name: text for name, text in problems.items() if name != "all_reduce"} == dict.fromkeys(
        ["broadcast", "scatter", "gather", "reduce", "all_gather"], ""
    )


def test_the_ring_sends_to_the_next_rank_and_receives_from_the_previous_in_one_batch(process_group_alone, monkeypatch):
    batches = []

    def deliver(batch):
        batches.append(sorted((op.op.__name__, op.peer, op.tensor.tolist()) for op in batch))
        for op in batch:
            if op.op is dist.irecv:
                op.tensor.fill_(op.peer)  # what the previous rank sends: its number
        return []

    # A lone isend or irecv here would fail: this process is rank 0 of 1, and rank 2 of 3 to the ring.
    monkeypatch.setattr(dist, "batch_isend_irecv", deliver)
    received = ring(2, 3, torch.device("cpu"))
    assert batches == [[("irecv", 1, [-1.0] * 3), ("isend", 0, [2.0] * 3)]]
    assert received.tolist() == [1.0] * 3


def ring_member(rank: int, world: int, out_dir: Path) -> None:
    """One process of a gloo group running the doctor's collectives, recording its batches of sends and receives."""
    batches = []
    batch_isend_irecv = dist.batch_isend_irecv

    def recorded(batch):
        batches.append(sorted((op.op.__name__, op.peer) for op in batch))
        return batch_isend_irecv(batch)

    dist.batch_isend_irecv = recorded
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir / 'store'}", rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT
    )
    problems = check_collectives(rank, world, torch.device("cpu"))
    dist.destroy_process_group()
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"problems": problems, "batches": batches}))


@pytest.mark.distributed
def test_the_ring_of_two_processes_sends_to_and_receives_from_the_same_peer(tmp_path):
    # The run of two nodes above has a ring of four; with two, each process's next is also its previous.
    mp.start_processes(ring_member, args=(2, tmp_path), nprocs=2, start_method="spawn")
    for rank in range(2):
        record = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert record["problems"] == dict.fromkeys(COLLECTIVES, ""), record
        assert record["batches"] == [[["irecv", 1 - rank], ["isend", 1 - rank]]]


@pytest.mark.parametrize("torch_has", ["all_gather_single", "all_gather_into_tensor"])
def test_all_gather_is_measured_into_one_tensor_per_message_size(torch_has, process_group_alone, monkeypatch):
    calls = []

    def gather(output, chunk):
        calls.append((torch_has, output, chunk))

    def refuse(name: str):
        def call(*args, **kwargs):
            raise AssertionError(f"all_gather measured with {name}")

        return call

    if torch_has == "all_gather_into_tensor":
        monkeypatch.delattr(dist, "all_gather_single", raising=False)  # torch before 2.13
    else:  # deprecated where all_gather_single exists
        monkeypatch.setattr(dist, "all_gather_into_tensor", refuse("all_gather_into_tensor"))
    monkeypatch.setattr(dist, torch_has, gather, raising=False)
    monkeypatch.setattr(dist, "all_gather", refuse("a list"))
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 4)  # each process gathers a quarter
    rows = comm_bench.run(4096, torch.device("cpu"))
    sizes = [row["bytes"] for row in rows if row["operation"] == "all_gather"]
    outputs = {id(output): output for _, output, _ in calls}
    assert sorted(output.numel() * 4 for output in outputs.values()) == sizes == [1024, 4096]
    assert all(name == torch_has and output.numel() == 4 * chunk.numel() for name, output, chunk in calls)


def check_gpu_line(output: str, gpus: int) -> None:
    """The doctor names the driver, CUDA and NCCL versions and every GPU, as this torch sees them."""
    line = re.search(r"^ok    NVIDIA driver (\S+), CUDA (\S+), NCCL (\S+); (\d+) visible GPU\(s\): (.+)$", output, re.M)
    assert line, output
    driver, cuda, nccl, visible, names = line.groups()
    assert re.fullmatch(r"\d+\.\d+(\.\d+)?", driver), driver
    assert (cuda, nccl) == (torch.version.cuda, ".".join(map(str, torch.cuda.nccl.version())))
    assert int(visible) == gpus and len(names.split(", ")) == gpus and all(names.split(", ")), names


@pytest.mark.distributed
@needs_gpus(1)
def test_doctor_on_one_gpu_passes_the_nccl_checks_and_measures_bandwidth(tmp_path):
    output, rows = one_node(tmp_path, "0")
    check_gpu_line(output, 1)
    for name in set(COLLECTIVES) - {"send/recv"}:  # a process alone has no ring
        assert f"ok    {name} on 1 processes (nccl)" in output
    assert {row["operation"] for row in rows} == set(comm_bench.OPERATIONS)
    for row in rows:
        algbw, busbw = float(row["algbw_GBps"]), float(row["busbw_GBps"])
        # One process moves nothing over a bus but for broadcast, whose bus bandwidth is its algorithm bandwidth.
        assert algbw > 0 and busbw == pytest.approx(algbw * comm_bench.bus_factor(row["operation"], 1))
    assert re.search(r"^broadcast\s+\d+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", output, re.M)


@pytest.mark.distributed
@needs_gpus(2)
def test_doctor_on_two_gpus_passes_the_nccl_ring_and_measures_bandwidth(tmp_path):
    output, rows = one_node(tmp_path, "0,1")
    check_gpu_line(output, 2)
    for name in COLLECTIVES:
        assert f"ok    {name} on 2 processes (nccl)" in output
    assert {row["operation"] for row in rows} == set(comm_bench.OPERATIONS)
    assert all(float(row["busbw_GBps"]) > 0 and row["processes"] == "2" for row in rows), rows
