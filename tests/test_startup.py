"""The start-up handshake: who is missing, what differs, and how fast the job says so."""

import io
import os
import re
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import HashStore

from tests.helpers import DDP_YAML, REPO, copy_project, free_port, launch, processes_in, run_script
from training.config.network import node_rank_problem
from training.job import join_progress
from training.job.roster import Member
from training.job.startup import StartupError, handshake
from training.job.store import master_wait

FACTS = {"num_nodes": 2, "devices per node": 2, "config": {"trainer.max_epochs": "5", "model.lr": "0.1"}}


def member(node: int, local: int, host: str = "", **facts) -> Member:
    return Member(node, local, host or f"host{node}", 1000 + 10 * node + local, {**FACTS, **facts})


def shake(
    members: list[Member],
    timeout: float = 5,
    fail_fast: bool = True,
    gives_up: dict[tuple[int, int], str] | None = None,
) -> dict[tuple[int, int], object]:
    """Run the handshake for every member in its own thread; return each one's result or error. ``gives_up``: the
    words with which a member (node, local rank) stops waiting, as when a process of its node ended."""
    store = HashStore()
    results: dict[tuple[int, int], object] = {}

    def run(me: Member) -> None:
        try:
            results[(me.node_rank, me.local_rank, me.pid)] = handshake(
                store,
                me,
                num_nodes=2,
                devices=2,
                timeout=timedelta(seconds=timeout),
                address="10.0.0.1:29500",
                leader=(me.node_rank, me.local_rank) == (0, 0),
                fail_fast=fail_fast,
                abandoned=lambda: (gives_up or {}).get((me.node_rank, me.local_rank), ""),
            )
        except StartupError as error:
            results[(me.node_rank, me.local_rank, me.pid)] = error

    threads = [threading.Thread(target=run, args=(m,)) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_everyone_arrives_and_gets_the_same_roster(capsys):
    everyone = [member(1, 1), member(0, 1), member(1, 0), member(0, 0)]
    results = shake(everyone)
    rosters = {tuple((m.node_rank, m.local_rank, m.host) for m in roster.members) for roster in results.values()}
    assert rosters == {((0, 0, "host0"), (0, 1, "host0"), (1, 0, "host1"), (1, 1, "host1"))}
    assert capsys.readouterr().err == "", "a job whose processes all come at once waits in silence"


def test_a_long_wait_says_who_joined_and_who_is_missing_a_line_at_a_time(capsys, monkeypatch):
    monkeypatch.setattr(join_progress, "QUIET_FOR", 0.0)
    monkeypatch.setattr(join_progress, "REPORT_EVERY", 0.5)
    shake([member(0, 0), member(0, 1), member(1, 0)], timeout=3)
    lines = capsys.readouterr().err.splitlines()
    leader = [line for line in lines if line.startswith("Waiting at")]
    assert 2 <= len(leader) <= 3 / 0.5 + 1, "a line every REPORT_EVERY seconds when stderr is no terminal"
    assert re.fullmatch(
        r"Waiting at 10\.0\.0\.1:29500 for the job's processes: 3 of 4 joined \(node 0 \(host0\) 2 of 2, node 1 "
        r"\(host1\) 1 of 2\); 0:00:0[0-3] waited of join_timeout 0:00:03\.",
        leader[-1],
    )
    worker = [line for line in lines if line.startswith("node 1 (host1) joined")]
    assert 2 <= len(worker) <= 3 / 0.5 + 1 and not any(line.startswith("node 0 (host0) joined") for line in lines)
    assert re.fullmatch(
        r"node 1 \(host1\) joined the job at 10\.0\.0\.1:29500 and waits for global rank 0's word: 3 of 4 processes "
        r"joined, 0:00:0[0-3] waited of join_timeout 0:00:03\.",
        worker[-1],
    )
    shake([member(0, 0), member(0, 1)], timeout=1)
    leader = [line for line in capsys.readouterr().err.splitlines() if line.startswith("Waiting at")]
    assert leader[-1].startswith(
        "Waiting at 10.0.0.1:29500 for the job's processes: 2 of 4 joined (node 0 (host0) 2 "
        "of 2); node rank 1 not yet (the job has num_nodes=2: for fewer nodes, set trainer.num_nodes or NUM_NODES); "
        "0:00:0"
    )


def test_on_a_terminal_the_wait_is_redrawn_in_place(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    report = join_progress.WaitReport()
    report.show(5, "Waiting: 1 of 2 joined")
    assert report.due == 6, "redrawn every second on a terminal"
    report.show(6, "Waiting: 1 of 2")
    report.close()
    assert sys.stderr.getvalue() == "\rWaiting: 1 of 2 joined\033[K\rWaiting: 1 of 2\033[K\n"


def test_a_node_that_never_arrives_is_named_after_the_timeout():
    started = time.monotonic()
    results = shake([member(0, 0), member(0, 1)], timeout=1)
    assert time.monotonic() - started < 30
    errors = {str(error) for error in results.values()}
    assert len(errors) == 1, "every process should stop with the same words"
    message = errors.pop()
    assert message.startswith("the job cannot start: only 2 of 4 processes joined within 0:00:01; node rank 1 never")
    assert "MASTER_ADDR and MASTER_PORT pointing at 10.0.0.1:29500" in message
    assert "logs/nodes/node<RANK>.log" in message


def test_a_process_missing_on_a_node_is_named():
    results = shake([member(0, 0), member(0, 1), member(1, 0)], timeout=1)
    message = str(results[(0, 0, 1000)])
    assert "only 3 of 4 processes joined" in message
    assert "node 1 lacks local rank 1 (a process there stopped before joining)" in message


def test_a_process_that_gives_up_stops_every_process_at_once_with_its_words():
    why = "the job cannot start: rank 3 (local rank 1, pid 1011) of node 1 (host1) was killed by SIGKILL"
    started = time.monotonic()
    results = shake([member(0, 0), member(0, 1), member(1, 0)], timeout=60, gives_up={(1, 0): why})
    assert time.monotonic() - started < 30, "the job waited for the join timeout"
    assert {str(result) for result in results.values()} == {why}


def test_a_different_node_count_fails_fast_and_names_the_fix():
    started = time.monotonic()
    results = shake([member(0, 0), member(0, 1), member(1, 0, num_nodes=3), member(1, 1, num_nodes=3)], timeout=60)
    assert time.monotonic() - started < 30, "a disagreement must not wait for the join timeout"
    message = str(results[(0, 0, 1000)])
    assert "num_nodes: node 0 (host0) has 2, node 1 (host1) has 3" in message
    assert "To fix: set trainer.num_nodes (or NUM_NODES) to the same value on every node" in message
    assert all(str(result) == message for result in results.values())


def test_config_differences_are_named_key_by_key():
    config = {"trainer.max_epochs": "3", "model.lr": "0.1", "data.seed": "1"}
    results = shake([member(0, 0), member(0, 1), member(1, 0, config=config), member(1, 1, config=config)])
    message = str(results[(0, 0, 1000)])
    assert "config differs between node 0 (host0) and node 1 (host1): data.seed (unset vs 1), trainer.max_epochs" in (
        message
    )
    assert "(5 vs 3)" in message and "model.lr" not in message


def test_a_node_rank_used_twice_is_named():
    twin = Member(1, 0, "hostX", 4242, FACTS)
    results = shake([member(0, 0), member(0, 1), member(1, 0), twin, member(1, 1)], timeout=3)
    message = str(results[(0, 0, 1000)])
    assert re.search(r"node rank 1 was started twice, on host(1|X) \(pid \d+\) and on host(1|X)", message)


def test_without_fail_fast_everyone_is_listed_and_every_difference_named():
    results = shake(
        [member(0, 0), member(0, 1, torch="2.0"), member(1, 0, lightning="2.1"), member(1, 1)], fail_fast=False
    )
    for roster in results.values():
        assert [(m.node_rank, m.local_rank) for m in roster.members] == [(0, 0), (0, 1), (1, 0), (1, 1)]
        assert sorted(roster.problems) == [  # in the order the processes joined, which is theirs to choose
            "lightning: node 0 (host0) has None, node 1 (host1) has 2.1",
            "torch: node 0 (host0) has None, node 0 (host0) has 2.0",
        ]


@pytest.mark.distributed
def test_a_master_without_its_worker_stops_after_the_join_timeout(tmp_path):
    # One process per node: the join timeout counts from when rank 0 starts waiting, so no sibling still
    # importing can be what is missing when it ends.
    project = copy_project(tmp_path / "node0")
    started = time.monotonic()
    settings = {"NUM_NODES": "2", "MASTER_PORT": str(free_port())}
    process = launch(project, "cpu:1", 0, "--trainer.strategy.init_args.join_timeout=0:00:03", **settings)
    output, _ = process.communicate(timeout=300)
    assert process.returncode != 0
    assert time.monotonic() - started < 3 + 120, "the master did not give up after the join timeout"
    assert "error: the job cannot start: only 1 of 2 processes joined within 0:00:03; node rank 1 never arrived" in (
        output
    )
    assert (
        "The job has num_nodes=2 (trainer.num_nodes in the config or on the command line, or NUM_NODES in the "
        "environment): if it is meant to run on this machine only, set num_nodes to 1; otherwise start node rank 1 "
        "with the same command."
    ) in output
    assert "Traceback" not in output


@pytest.mark.distributed
def test_a_local_rank_left_in_the_environment_is_named_when_the_other_processes_never_come(tmp_path):
    # As after `export LOCAL_RANK=0` from a hand-written launch script: Lightning starts no second process.
    args = [str(REPO / "cli.py"), "fit", "-c", DDP_YAML, "--trainer.strategy.init_args.join_timeout=0:00:03"]
    result = run_script(args, cwd=tmp_path, env={"LOCAL_RANK": "0", "MASTER_PORT": str(free_port())})
    assert result.returncode == 1
    assert "only 1 of 2 processes joined within 0:00:03; node 0 lacks local rank 1" in result.stderr
    assert "Node 0 was started with LOCAL_RANK=0 in its environment, so Lightning started no other" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.distributed
def test_nodes_with_different_num_nodes_fail_fast_naming_it(tmp_path):
    nodes = [copy_project(tmp_path / f"node{rank}") for rank in range(2)]
    port = str(free_port())
    started = time.monotonic()
    worker = launch(nodes[1], "cpu:2", 1, NUM_NODES="3", MASTER_PORT=port)
    master = launch(nodes[0], "cpu:2", 0, NUM_NODES="2", MASTER_PORT=port)
    outputs = [process.communicate(timeout=400)[0] for process in (master, worker)]
    assert time.monotonic() - started < 240, "the mismatch waited for the 10 minute join timeout"
    for process, output in zip((master, worker), outputs, strict=True):
        assert process.returncode != 0
        assert "error: the job cannot start, its processes disagree: num_nodes: node 0 (" in output
        assert output.count("error: the job cannot start") == 1, "one paragraph per node, not one per process"
        assert "Traceback" not in output
        assert "has 2, node 1 (" in output and "has 3." in output


@pytest.mark.distributed
def test_a_master_port_another_program_holds_stops_every_process_of_the_node_with_one_paragraph(tmp_path):
    # A program that listens on MASTER_PORT and never answers as the job's store would: the process Lightning
    # started beside rank 0 reaches it and would wait in a connection to it after rank 0 stopped.
    output = tmp_path / "output"
    with socket.create_server(("", 0)) as holder, output.open("w") as sink:
        port = holder.getsockname()[1]
        rank_zero = subprocess.Popen(
            [sys.executable, str(REPO / "cli.py"), "fit", "-c", DDP_YAML],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(REPO), "MASTER_PORT": str(port)},
            stdout=sink,
            stderr=subprocess.STDOUT,
        )
        assert rank_zero.wait(timeout=300) == 1
        left = processes_in(tmp_path)
    assert not left, f"processes {left} of the job outlived it"
    text = output.read_text()
    last = text.strip().splitlines()[-1]
    assert last.startswith(f"error: global rank 0 cannot listen on 127.0.0.1:{port}: ") and "EADDRINUSE" in last
    assert last.endswith("stop it, or choose another MASTER_PORT on every node.")
    assert "Traceback" not in text and "TCPStore.cpp" not in text
    assert not (tmp_path / "logs").exists()


def test_a_worker_waits_for_the_master_for_connect_timeout_where_it_is_set_and_shorter(monkeypatch):
    join_timeout = timedelta(minutes=10)
    monkeypatch.delenv("CONNECT_TIMEOUT", raising=False)
    assert master_wait(join_timeout) == (join_timeout, "join_timeout")
    monkeypatch.setenv("CONNECT_TIMEOUT", "300")
    assert master_wait(join_timeout) == (timedelta(minutes=5), "CONNECT_TIMEOUT")
    monkeypatch.setenv("CONNECT_TIMEOUT", "900")
    assert master_wait(join_timeout) == (join_timeout, "join_timeout")
    monkeypatch.setenv("CONNECT_TIMEOUT", "5m")
    with pytest.raises(StartupError, match=r"^CONNECT_TIMEOUT=5m is not a number of seconds\. Fix it in "):
        master_wait(join_timeout)


def test_a_node_rank_past_the_last_node_is_refused_unless_torchrun_numbers_the_nodes(monkeypatch):
    two_nodes = {"trainer": {"num_nodes": 2}}
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("NODE_RANK", raising=False)
    assert node_rank_problem(two_nodes) is None
    monkeypatch.setenv("NODE_RANK", "1")
    assert node_rank_problem(two_nodes) is None
    assert node_rank_problem({"trainer": {}}).startswith(
        "NODE_RANK=1 is out of range: the config has trainer.num_nodes=1, so node ranks are 0..0. Edit num_nodes"
    )
    monkeypatch.setenv("NODE_RANK", "one")
    assert node_rank_problem(two_nodes).startswith(
        "NODE_RANK=one is not a node rank: the config has trainer.num_nodes=2"
    )
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "ddp")
    assert node_rank_problem(two_nodes) is None
