"""The heartbeat of training/heartbeat/liveness.py on a real TCPStore, without training: who is lost, when, and the
paragraph.

Each test runs several processes' heartbeats as objects in this process; the exit that ends a real process is
replaced by a record of it. tests/test_lost_node.py runs the same on real jobs.
"""

import os
import socket
import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from tests.helpers import free_port
from training.heartbeat import liveness, verdicts, why_stopped
from training.heartbeat.heard import Heard
from training.heartbeat.liveness import Liveness

PEER_TIMEOUT = timedelta(seconds=2)
# A peer_timeout longer than these tests take: only the failed collective's own wait can end them.
QUICK_FAILURE = timedelta(seconds=5)
COMMAND = "./scripts/run_ddp_train.sh cpu:1 0 --trainer.max_epochs=3"


@pytest.fixture
def store():
    port = free_port()
    server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    yield server, port
    del server


class Exits(list):
    """The statuses the heartbeats exited with. As after ``os._exit``, the thread that asked never returns: it stays
    parked, so no heartbeat acts after the moment its process would have ended."""

    def __init__(self) -> None:
        super().__init__()
        self.threads: set[threading.Thread] = set()

    def __call__(self, status: int) -> None:
        self.threads.add(threading.current_thread())
        self.append(status)
        threading.Event().wait()


@pytest.fixture
def exits(monkeypatch):
    asked = Exits()
    monkeypatch.setattr(liveness.os, "_exit", asked)
    monkeypatch.setenv("LAUNCH_COMMAND", COMMAND)
    return asked


@pytest.fixture
def start(exits):
    started: list[Liveness] = []

    def run(
        port: int, rank: int, node: int, world_size: int = 2, peer_timeout: timedelta = PEER_TIMEOUT, **options
    ) -> Liveness:
        member = Liveness(
            ("127.0.0.1", port),
            {"rank": rank, "node": node, "local": 0},
            world_size,
            peer_timeout,
            timedelta(minutes=30),
            lambda: (1, 70),
            announce=True,
            **options,
        )
        member.start()
        started.append(member)
        return member

    yield run
    for member in started:  # none may outlive the test inside a store call (Liveness.stop says why)
        member.stop()
    # A watch that passed its last look at `stopped` may still stop the job: while os._exit is the test's, let each
    # watch end or park there, or it would end this whole test process once the patch is undone.
    wait_until(lambda: all(not member.watching.is_alive() or member.watching in exits.threads for member in started))


def wait_until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the heartbeats never got there"
        time.sleep(0.02)


def hear_each_other(*members: Liveness) -> None:
    wait_until(lambda: all(len(member.hearing.peers) == member.world_size for member in members))


def test_a_peer_silent_for_peer_timeout_stops_the_job_naming_node_checkpoint_and_command(store, exits, start, capsys):
    _, port = store
    zero, one = start(port, 0, 0), start(port, 1, 1)
    hear_each_other(zero, one)
    zero.checkpoint_saved("/runs/logs/toy/default/checkpoints/last.ckpt", 0, 64)
    one.stopped.set()  # silent from now on, as a machine that lost power
    silent_since = time.monotonic()
    wait_until(lambda: exits)
    assert time.monotonic() - silent_since >= PEER_TIMEOUT.total_seconds() - zero.period
    assert exits == [liveness.EXIT_STATUS]
    paragraph = capsys.readouterr().err
    host = socket.gethostname()
    assert paragraph.startswith(f"\nerror: the job lost node 1 ({host}, 127.0.0.1), last heard from at ")
    assert (
        "for longer than peer_timeout (0:00:02), so this node stopped rather than wait out the collective" in paragraph
    )
    assert "This node had reached epoch 1, step 70." in paragraph
    assert (
        "The last complete checkpoint is /runs/logs/toy/default/checkpoints/last.ckpt (epoch 0, step 64)." in paragraph
    )
    assert "once node 1 is back (or replaced), run the same command on every node again" in paragraph
    assert paragraph.rstrip().endswith(f"this node was started with: {COMMAND}")
    assert paragraph.count("\n") == 2, "not one paragraph"


def test_a_node_that_takes_a_peers_paragraph_names_its_own_command(store, exits, start):
    _, port = store
    zero, one = start(port, 0, 0), start(port, 1, 1)
    hear_each_other(zero, one)
    paragraph = "the job lost node 2 (...). This node had reached epoch 1, step 70. ..."
    one.state = {"state": "stopping", "verdict": f"{paragraph}; this node was started with: OTHER cpu:1 1"}
    one._publish()
    wait_until(lambda: zero.hearing.peers[1].beat.get("state") == "stopping")
    assert zero.verdict(PEER_TIMEOUT.total_seconds(), "") == f"{paragraph}; this node was started with: {COMMAND}"


class Link:
    """A relay to the store that can be cut: afterwards no byte passes either way, and the connections stay open,
    as when a cable is pulled."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.cut = threading.Event()
        self.held: list[socket.socket] = []
        threading.Thread(target=self.accept, daemon=True).start()

    def accept(self) -> None:
        while True:
            near, _ = self.listener.accept()
            self.held.append(near)
            if self.cut.is_set():
                continue  # held open, never answered
            far = socket.create_connection(("127.0.0.1", self.target))
            for source, sink in ((near, far), (far, near)):
                threading.Thread(target=self.relay, args=(source, sink), daemon=True).start()

    def relay(self, source: socket.socket, sink: socket.socket) -> None:
        while (data := source.recv(65536)) and not self.cut.is_set():
            sink.sendall(data)


def test_a_cut_link_stops_both_sides_each_naming_the_other(store, exits, start, capsys):
    _, port = store
    link = Link(port)
    zero, one = start(port, 0, 0), start(link.port, 1, 1)
    hear_each_other(zero, one)
    link.cut.set()
    wait_until(lambda: len(exits) == 2)
    output = capsys.readouterr().err
    assert f"error: the job lost node 1 ({socket.gethostname()}, 127.0.0.1), last heard from at " in output
    assert (
        f"error: the job lost node 0 ({socket.gethostname()}, 127.0.0.1): the job's store at 127.0.0.1:{link.port}, "
        "which global rank 0 holds there, has not answered since "
    ) in output
    assert "once node 0 is back" in output and "once node 1 is back" in output


def test_a_slow_peer_and_one_that_finished_are_not_lost(store, exits, start):
    _, port = store
    members = [start(port, rank, rank) for rank in range(3)]
    hear_each_other(*members)
    members[2].stop()  # finished: its last beat says so
    assert not members[2].beating.is_alive(), "the heartbeat outlived stop()"
    # Every process but the finished one stays silent in its own work (a long save, validation or first step)
    # for twice peer_timeout: the heartbeat threads run regardless.
    time.sleep(2 * PEER_TIMEOUT.total_seconds())
    assert exits == []
    assert members[0].verdict(PEER_TIMEOUT.total_seconds(), "") is None


@pytest.fixture
def short_grace(monkeypatch):
    # Four heartbeats of QUICK_FAILURE's (the product's 10 s are five of a 60 s peer_timeout's).
    monkeypatch.setattr(verdicts, "FAILURE_GRACE", timedelta(seconds=2))


def test_after_a_failed_collective_a_silent_peer_is_named_at_once(store, exits, start, short_grace):
    _, port = store
    zero, one = (start(port, rank, rank, peer_timeout=QUICK_FAILURE) for rank in range(2))
    hear_each_other(zero, one)
    one.stopped.set()
    paragraph = zero.failed(RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.0.2]:3"))
    assert paragraph.startswith(f"the job lost node 1 ({socket.gethostname()}, 127.0.0.1), last heard from at ")
    assert "and a collective with it failed (RuntimeError: Connection closed by peer [10.0.0.2]:3), so" in paragraph
    assert exits == []


def test_a_peer_whose_last_beat_arrives_late_after_the_failure_is_still_named(store, exits, start, short_grace):
    _, port = store
    zero, one = (start(port, rank, rank, peer_timeout=QUICK_FAILURE) for rank in range(2))
    hear_each_other(zero, one)
    one.stopped.set()
    one.beating.join()
    wait_until(lambda: zero.hearing.peers[1].beat["count"] == one.count)
    # As a loaded machine would: node 1's last beat reaches node 0 well after the collective failed, so it has not
    # been silent for the grace when the grace after the failure is over.
    last = zero.hearing.peers[1]
    zero.hearing.peers[1] = Heard(last.beat, time.monotonic() + 1.5, last.changed_at)
    paragraph = zero.failed(RuntimeError("Connection closed by peer [10.0.0.2]:3"))
    assert paragraph is not None and paragraph.startswith(f"the job lost node 1 ({socket.gethostname()}, 127.0.0.1)")


@pytest.mark.parametrize(
    ("node_log", "where_the_traceback_is"),
    [("logs/nodes/node1.log", "Its node's log (logs/nodes/node1.log there)"), (None, "Its output on that node")],
)
def test_after_a_failed_collective_a_peer_that_stopped_with_an_error_is_named(
    store, exits, start, short_grace, monkeypatch, node_log, where_the_traceback_is
):
    # The launcher names its node's log file; a process started otherwise has its traceback in its own output.
    if node_log:
        monkeypatch.setenv("DDP_NODE_LOG", node_log)
    else:
        monkeypatch.delenv("DDP_NODE_LOG", raising=False)
    _, port = store
    zero, one = (start(port, rank, rank, peer_timeout=QUICK_FAILURE) for rank in range(2))
    hear_each_other(zero, one)
    one.errored(ValueError("the loss is nan\nat step 70"))
    wait_until(lambda: zero.hearing.peers[1].beat["state"] == "failed")
    paragraph = zero.failed(RuntimeError("Connection closed by peer"))
    assert paragraph.startswith(
        f"rank 1 (local rank 0) of node 1 ({socket.gethostname()}, 127.0.0.1) stopped with an error: ValueError: the "
        f"loss is nan. {where_the_traceback_is} has the traceback; every other process stopped with it."
    )


def test_a_collective_timeout_while_a_peer_is_stalled_names_that_peer_and_where_it_is(store, exits, start, capsys):
    _, port = store
    in_dataset = ['  File "/home/me/my_pkg/data.py", line 42, in __getitem__\n']
    waiting = [
        '  File "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py", line 9, in barrier\n'
    ]
    progress = {"stage": "validate", "run": "fit", "quiet": 900.0, "epoch": 1, "step": 32}
    stalled = {"batches": 33, "stack": in_dataset, "place": "__getitem__ (/home/me/my_pkg/data.py:42)", **progress}
    stall = (timedelta(seconds=1), timedelta(0))  # reported, but only the collective's timeout stops the job
    zero = start(port, 0, 0, activity=lambda: {"batches": 34, "stack": waiting, **progress}, stall=stall)
    one = start(port, 1, 0, activity=lambda: stalled, stall=stall)
    hear_each_other(zero, one)
    wait_until(lambda: all("stack" in peer.beat for peer in zero.hearing.peers.values()))
    paragraph = zero.failed(raised_in_a_collective("[gloo/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv"))
    assert (
        paragraph.startswith("the job stopped: rank 1 (local rank 0, pid ")
        and ") made no progress in validation for 900 s (at epoch 1, step 32), longer than the collective timeout "
        "(0:30:00), while the other processes waited for it in a collective. Its main thread was in __getitem__ "
        "(/home/me/my_pkg/data.py:42)"
        in paragraph
    ), paragraph
    assert "if such waits are expected, raise trainer.strategy.init_args.timeout" in paragraph
    assert "has made no progress in validation for 900 s" in capsys.readouterr().err  # the report that came first


def raised_in_a_collective(message: str) -> RuntimeError:
    """``message`` raised from a function named as torch.distributed's collectives, in their file."""
    namespace: dict = {}
    source = "def all_reduce(message):\n    raise RuntimeError(message)\n"
    exec(compile(source, os.path.join("torch", "distributed", "distributed_c10d.py"), "exec"), namespace)
    try:
        namespace["all_reduce"](message)
    except RuntimeError as error:
        return error
    raise AssertionError("not raised")


def test_a_collective_timeout_with_every_peer_alive_names_the_collective_and_the_setting(
    store, exits, start, short_grace
):
    _, port = store
    zero, one = (start(port, rank, rank, peer_timeout=QUICK_FAILURE) for rank in range(2))
    hear_each_other(zero, one)
    error = raised_in_a_collective("[gloo/unbound_buffer.cc:78] Timed out waiting 1800000ms for recv operation")
    paragraph = zero.failed(error)
    assert paragraph.startswith(
        "torch.distributed.all_reduce waited longer than the collective timeout (0:30:00) and failed, while every "
        "process of the job kept sending its heartbeat: no node was lost"
    )
    assert "raise trainer.strategy.init_args.timeout (now 0:30:00) in the config or on the command line." in paragraph
    assert "run the same command on every node again" in paragraph and "once node" not in paragraph


@pytest.mark.parametrize(
    ("error", "collective"),
    [
        (RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer"), True),
        (RuntimeError("NCCL communicator was aborted"), True),
        (ValueError("Connection closed by peer"), False),
        (RuntimeError("CUDA out of memory"), False),
    ],
)
def test_collective_failures_are_told_from_other_errors(error, collective):
    assert why_stopped.is_collective_failure(error) == collective
