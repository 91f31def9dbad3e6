"""Lightning's DDPStrategy, with a start-up handshake that explains a job that cannot start."""

import os
import signal
import socket
from datetime import timedelta
from typing import Any

import lightning
import torch
from lightning.fabric.utilities.distributed import _init_dist_connection
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy
from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.distributed import PrefixStore, Store, TCPStore

from training.startup import Member, StartupError, handshake


class DDPStrategy(LightningDDPStrategy):
    """DDP whose processes shake hands before the process group starts.

    Each process reports its node, host, versions, devices per node, ``num_nodes`` and the ``startup_facts``
    the CLI adds (a digest of the config and the code, the checkpoint it loads). Global rank 0 waits up to
    ``join_timeout`` for all of them: a node that never arrives, or nodes that disagree, stop the job at once
    with one paragraph naming who is missing or what differs, on every node, instead of a hang or a store
    timeout after the collective ``timeout``. The handshake uses the job's own TCPStore at MASTER_ADDR:MASTER_PORT.

    Args:
        join_timeout: how long global rank 0 waits for every process to arrive, e.g. ``"0:10:00"``.
        *args, **kwargs: those of Lightning's DDPStrategy.
    """

    def __init__(self, *args: Any, join_timeout: timedelta = timedelta(minutes=10), **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.join_timeout = join_timeout
        self.startup_facts: dict[str, Any] = {}

    def setup_distributed(self) -> None:
        # Lightning's DDPStrategy.setup_distributed, with the handshake's store handed to the process group.
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._get_process_group_backend()
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        if self.world_size > 1:
            kwargs["store"] = self._join()
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)

    def _join(self) -> Store:
        environment = self.cluster_environment
        address = f"{environment.main_address}:{environment.main_port}"
        store = self._connect(environment.main_address, environment.main_port, address)
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
                **self.startup_facts,
            },
        )
        try:
            roster = handshake(
                store,
                me,
                num_nodes=self.num_nodes,
                devices=self.num_processes,
                timeout=self.join_timeout,
                address=address,
                leader=self.global_rank == 0,
            )
        except StartupError:
            # The processes Lightning started on this node may still be importing: they would only wait
            # for a store that is gone, so stop them with this one.
            if isinstance(self.launcher, _SubprocessScriptLauncher):
                self.launcher.kill(signal.SIGKILL)
            raise
        hosts = dict.fromkeys(member.where for member in roster.members)
        rank_zero_info(f"All {len(roster.members)} processes joined: {', '.join(hosts)}")
        return store

    def _connect(self, host: str, port: int, address: str) -> Store:
        # Under torchrun every process is a client of the agent's store, which outlives a restart of the
        # workers: a fresh prefix per attempt keeps the new workers from reading the dead ones' keys.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        serve = self.global_rank == 0 and not agent_store
        try:
            store = TCPStore(host, port, is_master=serve, timeout=self.join_timeout, wait_for_workers=False)
        except RuntimeError as error:
            if serve:
                raise StartupError(
                    f"global rank 0 cannot listen on {address}: {error}. Another job (or an earlier run still "
                    "shutting down) holds the port: stop it, or choose another MASTER_PORT on every node."
                ) from error
            raise StartupError(
                f"node {self.node_rank} cannot reach the master at {address} within {self.join_timeout}: {error}. "
                "Check that node 0 is running, that every node uses the same MASTER_ADDR and MASTER_PORT, and that "
                "the master's firewall lets this node reach that port."
            ) from error
        if agent_store:
            return PrefixStore(f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        return store
