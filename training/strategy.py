"""Lightning's DDPStrategy, with a start-up handshake that explains a job that cannot start and a heartbeat that
explains a job that lost a node."""

import atexit
import gc
import os
import signal
import socket
import weakref
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import lightning
import torch
import torch.distributed as dist
from lightning.pytorch import Trainer
from lightning.pytorch.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed import Store
from torch.distributed.constants import default_pg_timeout

from training.checkpoints.agreement import loads_problem, model_mismatch, without_compile
from training.checkpoints.save_agreement import SaveAgreement
from training.exact_evaluation import ExactEvaluation, quiet_lightnings_advice
from training.heartbeat.liveness import Liveness
from training.heartbeat.stall import Activity
from training.job import node_processes
from training.job.elastic import nodes_present
from training.job.fingerprint import checkpoint_fact, code_digest
from training.job.node_processes import NodeProcesses
from training.job.process_group import leave_process_group
from training.job.roster import Member
from training.job.startup import StartupError, handshake, started_outside_advice
from training.job.store import connect
from training.private_api import watch_started_processes


class DDPStrategy(SaveAgreement, ExactEvaluation, LightningDDPStrategy):
    """DDP whose processes shake hands before the process group starts.

    Each process reports its node, host, versions, devices per node, ``num_nodes``, a digest of the code it
    imported and the ``startup_facts`` the CLI adds (the resolved config). Global rank 0 waits up to
    ``join_timeout`` for all of them: a node that never arrives, or nodes that disagree, stop the job at once
    with one paragraph naming who is missing or what differs, on every node, instead of a hang or a store
    timeout after the collective ``timeout``. The handshake uses the job's own TCPStore at MASTER_ADDR:MASTER_PORT.
    Once the checkpoint is loaded, the processes check that they all loaded the same one and that it fits the
    model, again stopping with one paragraph.

    While the job runs, every process sends a heartbeat through the same store (training/heartbeat/liveness.py); a
    process not heard from for ``peer_timeout`` stops the job on every node that still runs, with one paragraph
    naming the lost node, the last complete checkpoint and the command that resumes, instead of a wait for the
    collective ``timeout``. A collective that fails is explained the same way.

    Args:
        join_timeout: how long global rank 0 waits for every process to arrive, e.g. ``"0:10:00"``.
        peer_timeout: how long a process may go unheard before the job counts it as lost, e.g. ``"0:01:00"``.
        min_nodes: the fewest nodes an elastic job goes on with, under torchrun (training/job/elastic.py);
            ``trainer.num_nodes`` is then the most. None: always ``trainer.num_nodes``.
        stall_report, stall_timeout: a process that made no progress (training, validating, testing, predicting)
            for this long while the others wait for it is named in every node's log; then the job stops
            (training/heartbeat/stall.py). 0: never.
        exact_evaluation: validation and test count each sample once wherever every process still runs as many
            batches (training/exact_evaluation.py); False: Lightning's shares, padded with repeats to one size.
        *args, **kwargs: those of Lightning's DDPStrategy.
    """

    def __init__(
        self,
        *args: Any,
        timeout: timedelta = default_pg_timeout,
        join_timeout: timedelta = timedelta(minutes=10),
        peer_timeout: timedelta = timedelta(minutes=1),
        min_nodes: int | None = None,
        stall_report: timedelta = timedelta(minutes=2),
        stall_timeout: timedelta = timedelta(minutes=5),
        exact_evaluation: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, timeout=timeout, **kwargs)
        self.exact_evaluation = exact_evaluation
        if exact_evaluation:
            quiet_lightnings_advice()
        self.min_nodes = min_nodes
        self.stall = (stall_report, stall_timeout)
        self.configured_nodes = 1  # the config's num_nodes, which the Trainer sets below
        self.timeout = timeout
        self.join_timeout = join_timeout
        self.peer_timeout = peer_timeout
        self.liveness: Liveness | None = None
        self.running: Trainer | None = None
        self.saved: dict[str, Any] | None = None  # a checkpoint this process saw saved, complete at the next barrier
        self.startup_facts: dict[str, Any] = {}
        self.checkpoint_problem = ""
        # Read before Lightning's launcher sets it: given by the user, it means the processes are started outside.
        self.local_rank_given = os.environ.get("LOCAL_RANK")
        if self.local_rank_given is None:
            node_processes.mark_as_starter()
        watch_started_processes(node_processes.watch)
        self.wrapper: Callable[[], Any] = lambda: None  # the DDP wrapper, while it lives

    @property
    def num_nodes(self) -> int:
        return LightningDDPStrategy.num_nodes.fget(self)

    @num_nodes.setter
    def num_nodes(self, configured: int) -> None:
        # The Trainer sets the config's num_nodes once the cluster environment is known: an elastic job has as many
        # as torchrun's rendezvous gathered.
        self.configured_nodes = configured
        present = nodes_present(self.min_nodes, configured, self.cluster_environment, self.num_processes)
        LightningDDPStrategy.num_nodes.fset(self, present)

    def setup_distributed(self) -> None:
        # The process group starts on the handshake's store; Lightning's own setup then finds it started.
        self.set_world_ranks()
        if self.world_size > 1 and not dist.is_initialized():
            backend = self.process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
            store = self._join()
            # Before the process group forms: a process that dies while the others wait for it there is named
            # within peer_timeout, not after the collective timeout.
            self.liveness = self._liveness()
            self.liveness.start()
            dist.init_process_group(
                backend,
                store=store,
                rank=self.global_rank,
                world_size=self.world_size,
                timeout=self.timeout,
                device_id=self.root_device if self.root_device.type != "cpu" else None,
            )
            atexit.register(leave_process_group, lambda: self.wrapper())
            rank_zero_info(f"Process group started: {backend}, {self.world_size} processes, timeout {self.timeout}.")
        super().setup_distributed()

    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        # SIGTERM's stop and Ctrl-C are no errors; a StartupError is already the whole job's verdict.
        if self.liveness is None or not isinstance(exception, Exception) or isinstance(exception, StartupError):
            return
        self.liveness.errored(exception, self.running)

    def configure_ddp(self) -> None:
        super().configure_ddp()
        self.wrapper = weakref.ref(self.model)

    def teardown(self) -> None:
        if self.liveness is not None:
            self.liveness.stop()
            self.liveness = None
        super().teardown()  # Lightning unwraps the model: the DDP wrapper goes, while the process group lives on
        if self.wrapper() is not None:  # held in a reference cycle
            gc.collect()

    def load_model_state_dict(self, checkpoint: dict[str, Any], strict: bool = True) -> None:
        # Reported in setup() by every process at once: a process that raised here alone would leave the
        # others waiting for it in a collective.
        # strict is the module's strict_loading: without it a partial checkpoint is what the user asked for.
        model = self.lightning_module.state_dict()
        checkpoint["state_dict"] = without_compile(model, checkpoint["state_dict"])  # compiled, or not, the same
        self.checkpoint_problem = model_mismatch(model, checkpoint["state_dict"]) if strict else ""
        if not self.checkpoint_problem:
            super().load_model_state_dict(checkpoint, strict)

    def setup(self, trainer: Trainer) -> None:
        # Each process resolved ckpt_path (``last`` included) on its own filesystem: all must have loaded one
        # and the same checkpoint, which also fits the model, before DDP copies rank 0's weights to the rest.
        mine = (
            self._where(),
            checkpoint_fact(trainer.ckpt_path),
            self.checkpoint_problem,
        )
        everyone = [mine]
        if self.world_size > 1:
            everyone = [None] * self.world_size
            dist.all_gather_object(everyone, mine)
        self.checkpoint_problem = ""
        self.running = trainer
        if problem := loads_problem(everyone, trainer.ckpt_path, trainer.state.fn == TrainerFn.FITTING):
            raise StartupError(problem)
        super().setup(trainer)

    def _join(self) -> Store:
        environment = self.cluster_environment
        host, port = environment.main_address, environment.main_port
        me = Member(
            node_rank=self.node_rank,
            local_rank=self.local_rank,
            host=socket.gethostname(),
            pid=os.getpid(),
            device=str(self.root_device),
            facts={
                "num_nodes": self.num_nodes,
                "devices per node": self.num_processes,
                "torch": torch.__version__,
                "lightning": lightning.__version__,
                "project code": code_digest(),
                **self.startup_facts,
            },
        )
        try:
            store = connect(
                host, port, self.global_rank == 0, self.join_timeout, f"node {self.node_rank}", self._abandoned
            )
            roster = handshake(
                store,
                me,
                num_nodes=self.num_nodes,
                devices=self.num_processes,
                timeout=self.join_timeout,
                address=f"{host}:{port}",
                leader=self.global_rank == 0,
                advice=started_outside_advice(
                    self.node_rank,
                    self.local_rank_given if isinstance(self.cluster_environment, LightningEnvironment) else None,
                ),
                abandoned=self._abandoned,
            )
        except StartupError:
            # The processes Lightning started on this node may still be importing: they would only wait for a
            # store that is gone, or, when the port is another program's, hang in a connection to it.
            if self.launcher is not None:
                self.launcher.kill(signal.SIGKILL)
            raise
        hosts = dict.fromkeys(member.where for member in roster.members)
        rank_zero_info(f"All {len(roster.members)} processes joined: {', '.join(hosts)}")
        return store

    def _where(self) -> str:
        return f"node {self.node_rank} ({socket.gethostname()})"

    def _node_processes(self) -> NodeProcesses:
        return NodeProcesses(self._where(), self.node_rank * self.num_processes)

    def _abandoned(self) -> str:
        return self._node_processes().abandoned()

    def _liveness(self) -> Liveness:
        environment = self.cluster_environment
        return Liveness(
            (environment.main_address, environment.main_port),
            {"rank": self.global_rank, "node": self.node_rank, "local": self.local_rank},
            self.world_size,
            self.peer_timeout,
            self.timeout,
            self._progress,
            announce=self.local_rank == 0,
            node=self._node_processes(),
            activity=Activity(lambda: self.running, self.stall[0].total_seconds()),
            stall=self.stall,
            nodes=self.num_nodes,
        )

    def _progress(self) -> tuple[int, int] | None:
        trainer = self.running
        return (trainer.current_epoch, trainer.global_step) if trainer is not None else None
