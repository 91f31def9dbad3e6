"""Liveness of the processes of a job, kept apart from the collectives and their timeout.

Every process writes a heartbeat into the job's TCPStore every ``period`` and reads everyone else's, from a
thread with its own store client: training may sit in a collective, a checkpoint save or a validation for as
long as it likes without missing a beat, and no training step waits for it. A second thread only looks at the
clock, so a store operation that never returns (a cut link) cannot hide a lost peer. When a peer has been
silent for ``peer_timeout``, or the store itself (which lives in global rank 0's process, on node 0) has, every
surviving process stops the job with one paragraph (training/heartbeat/verdicts.py says which) and ``os._exit``: a
gloo collective cannot be aborted, and the one in flight would wait out the strategy's collective timeout.
"""

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from torch.distributed import Store

from training.heartbeat import why_stopped
from training.heartbeat.heard import Hearing
from training.heartbeat.verdicts import Verdicts
from training.job.forked import exit_at_once
from training.job.node_processes import NodeProcesses, end_frozen_starter, end_later, speaks_for_node
from training.job.store import address_towards, connect

PREFIX = "liveness"
EXIT_STATUS = 1
# What a store call raises once the store is gone or out of reach (torch's DistError derives from RuntimeError).
STORE_ERRORS = (RuntimeError, OSError, ValueError)


def beat_period(peer_timeout: timedelta) -> float:
    """Seconds between heartbeats: a tenth of ``peer_timeout``, at most 2 s."""
    return min(peer_timeout.total_seconds() / 10, 2.0)


class Liveness(Verdicts):
    """The heartbeat of one process and its watch over the others.

    Args:
        store: ``(host, port)`` of the job's store (training/job/store.py).
        me: this process's ``rank``, ``node`` and ``local`` rank.
        world_size: the number of processes of the job.
        peer_timeout: how long a peer may stay silent before it counts as lost.
        collective_timeout: the strategy's ``timeout``, named in the paragraphs.
        progress: returns this process's ``(epoch, step)``, or None before training.
        announce: whether this process prints the paragraph; with ``node``, also whichever speaks for the node.
        node: what this process knows of its node's other processes (training/job/node_processes.py): one killed is
            named at once; the end of the one that started this process, once a collective fails or the store
            falls silent (it may also have ended well, a moment before this one).
        activity: this process's progress in training, for its heartbeat (training/heartbeat/stall.py).
        stall: ``(stall_report, stall_timeout)``: a process that made no progress (training, validating, testing,
            predicting) for the first while the others wait for it is named in every node's log; after the second
            (unless 0) the job stops.
        nodes: how many nodes the job has, for the command that resumes it.
    """

    def __init__(
        self,
        store: tuple[str, int],
        me: dict[str, int],
        world_size: int,
        peer_timeout: timedelta,
        collective_timeout: timedelta,
        progress: Callable[[], tuple[int, int] | None],
        announce: bool,
        node: NodeProcesses | None = None,
        activity: Callable[[], dict[str, Any]] = dict,
        stall: tuple[timedelta, timedelta] = (timedelta(0), timedelta(0)),
        nodes: int = 2,
    ) -> None:
        self.store = store
        self.store_address = f"{store[0]}:{store[1]}"
        self.me = {**me, "pid": os.getpid(), "host": socket.gethostname(), "address": address_towards(*store)}
        self.activity = activity
        self.stall_report, self.stall_timeout = stall
        self.reported: dict[int, tuple[int, str]] = {}
        self.world_size = world_size
        self.peer_timeout = peer_timeout
        self.period = beat_period(peer_timeout)
        self.progress = progress
        self.describe = {
            "command": why_stopped.launch_command(),
            "collective_timeout": collective_timeout,
            "nodes": nodes,
        }
        self.announce = announce
        self.node = node
        self.state: dict[str, Any] = {"state": "running"}
        self.trainer_fn = "fit"
        self.checkpoint: dict[str, Any] | None = None
        self.hearing = Hearing(world_size, self.period)
        self.client: Store | None = None
        self.count = 0
        self.stopped = threading.Event()
        self.stopping = threading.Lock()
        self.beating = threading.Thread(target=self._beat, name="liveness-beat", daemon=True)
        self.watching = threading.Thread(target=self._watch, name="liveness-watch", daemon=True)
        self.why = (
            f"for longer than peer_timeout ({peer_timeout}), so this node stopped rather than wait out the "
            f"collective timeout ({collective_timeout})"
        )

    def start(self) -> None:
        self.beating.start()
        self.watching.start()

    def stop(self) -> None:
        """This process ends (normally, or after its own error): nobody may take it for lost once it is gone."""
        if self.state["state"] == "running":
            self.state = {"state": "done"}
            self._publish()
        self.stopped.set()
        # A daemon thread that comes back from a store call while the interpreter exits aborts the process
        # ("terminate called without an active exception", torch issue 38228): let the call end first. It ends
        # at once unless the store hangs, and then it outlasts the process instead.
        if self.beating.is_alive():
            self.beating.join(max(2 * self.period, 5.0))

    def checkpoint_saved(self, path: str, epoch: int, step: int) -> None:
        """A checkpoint saved completely (training/checkpoints/save_agreement.py says when a process counts it so)."""
        self.checkpoint = {"path": path, "epoch": epoch, "step": step}
        self._publish()

    def errored(self, error: BaseException, trainer: Any = None) -> None:
        """This process stops with its own ``error`` (in ``trainer``'s run): with the whole job, under the paragraph
        that explains it where one does (a failed collective, the run's directory gone, memory that ran out); else
        the others name it instead of waiting for its silence."""
        if why_stopped.is_collective_failure(error) and (paragraph := self.failed(error)):
            self.stop_job(paragraph)
        if paragraph := self.own_failure(error, trainer):
            self.stop_job(paragraph, only_here=True)
        # The launcher keeps each node's output in a log file (scripts/run_ddp_train.sh): the others name it.
        self.state = {"state": "failed", "error": why_stopped.one_line(error), "log": os.environ.get("DDP_NODE_LOG")}
        self._publish()
        # Said after the traceback by the process the user started, once the node's others ended (cli.py); an
        # exception class with __slots__ takes no attribute, and the traceback alone is said.
        with contextlib.suppress(AttributeError):
            error.job_stopped = why_stopped.own_error(self.me, why_stopped.one_line(error), self._tail(None))

    def stop_job(self, paragraph: str, only_here: bool = False) -> None:
        """Print ``paragraph`` (once per node) and end the process; the first caller wins, others wait for it.

        With ``only_here`` (a verdict no other process reaches by itself: the run's directory gone, memory that ran
        out), and always in global rank 0's process, which holds the store, first wait a few heartbeats at most until
        every other process still beating has heard it and stops with it: they hear it through the store, which
        ends with global rank 0's process (without the wait, a process stalled in a collective's place would name
        node 0 as lost instead)."""
        if not self.stopping.acquire(blocking=False):
            threading.Event().wait()
        self.state = {"state": "stopping", "verdict": paragraph}
        self._publish()
        deadline = time.monotonic() + 5 * self.period
        wait = only_here or self.me["rank"] == 0
        while wait and time.monotonic() < deadline and not self._all_stopping():
            time.sleep(self.period / 4)
        if self.node is not None:  # a frozen process that started this one would speak for the node, and never end
            end_frozen_starter()
        if self._speaks():
            sys.stdout.flush()
            print(f"\nerror: {paragraph}", file=sys.stderr, flush=True)
        if self.node is not None:
            end_later()
        exit_at_once(EXIT_STATUS)

    def _all_stopping(self) -> bool:
        """Whether every other process has been heard and has stopped running, or has been silent for a while (lost:
        it never will)."""
        heard = dict(self.hearing.peers)
        silent = self.hearing.silent(time.monotonic(), 3 * self.period)
        others = [rank for rank in range(self.world_size) if rank != self.me["rank"]]
        return all(rank in heard and (heard[rank].beat.get("state") != "running" or rank in silent) for rank in others)

    def _speaks(self) -> bool:
        """Whether this process prints what its node says: local rank 0, or whichever speaks for the node."""
        return self.announce or (self.node is not None and speaks_for_node())

    def _beat_value(self) -> str:
        self.count += 1
        activity = self.activity()
        self.trainer_fn = activity.get("run", self.trainer_fn)
        beat = {"count": self.count, **self.me, **self.state, **activity}
        if self.checkpoint:
            beat["checkpoint"] = self.checkpoint
        return json.dumps(beat)

    def _publish(self) -> None:
        """Send this process's state now, waiting at most one period: a client serialises its operations, and
        the heartbeat's own may hang on a store that stopped answering."""
        client = self.client
        if client is None:
            return

        def send() -> None:
            with contextlib.suppress(*STORE_ERRORS):
                client.set(f"{PREFIX}/{self.me['rank']}", self._beat_value())

        sender = threading.Thread(target=send, name="liveness-publish", daemon=True)
        sender.start()
        sender.join(self.period)

    def _beat(self) -> None:
        keys = [f"{PREFIX}/{rank}" for rank in range(self.world_size)]
        present: list[str] = []
        while not self.stopped.is_set():
            if self.node and self.node.starter_ended():  # on node 0 it held the store: no call that would fail
                self.stopped.wait(self.period)
                continue
            try:
                if self.client is None:
                    self.client = self._reconnect()
                self.client.set(f"{PREFIX}/{self.me['rank']}", self._beat_value())
                present += [key for key in keys if key not in present and self.client.check([key])]
                values = self.client.multi_get(present) if present else []
                self.hearing.answered(
                    {int(key.rsplit("/", 1)[1]): json.loads(value) for key, value in zip(present, values, strict=True)}
                )
            except STORE_ERRORS:
                self.client = None
            self.stopped.wait(self.period)

    def _reconnect(self) -> Store:
        # A failed store operation makes torch print a C++ backtrace: knock on the port first, quietly.
        host, port = self.store
        with socket.create_connection((host, port), timeout=self.period):
            pass
        # Longer than peer_timeout: a store that stops answering is the watch's to report, without the warning
        # torch prints when an operation times out.
        timeout = max(2 * self.peer_timeout, timedelta(seconds=5))
        return connect(host, port, False, timeout, f"node {self.me['node']}")

    def _watch(self) -> None:
        last = time.monotonic()
        while not self.stopped.wait(self.period):
            now = time.monotonic()
            # Woken far later than asked: this process was frozen (Ctrl-Z, SIGSTOP) or starved. The silences it would
            # see are its own; a job suspended as a whole and resumed goes on.
            if now - last > self.period + max(2 * self.period, self.peer_timeout.total_seconds() / 4):
                self.hearing.resumed(now)
            last = now
            if paragraph := self.verdict(self.peer_timeout.total_seconds(), self.why):
                self.stop_job(paragraph)
            if self.stall_report:
                reports, paragraph = self.stalls()
                for report in reports if self._speaks() else []:
                    print(f"\n{report}", file=sys.stderr, flush=True)
                if paragraph:
                    self.stop_job(paragraph)
