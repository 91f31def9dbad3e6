"""The job's TCPStore at MASTER_ADDR:MASTER_PORT, which the start-up handshake, the process group and the heartbeat
share: global rank 0 serves it (under torchrun the agent does), every other process is a client."""

import os
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore

from training.job.startup import StartupError


def connect(host: str, port: int, leader: bool, timeout: timedelta, node: str) -> Store:
    """The store, served by this process when it is the ``leader`` (global rank 0) outside torchrun; a port that is
    taken or a master that cannot be reached within ``timeout`` is a StartupError naming ``node`` and the fix."""
    address = f"{host}:{port}"
    prefix = attempt_prefix()
    serve = leader and prefix is None
    try:
        store = TCPStore(host, port, is_master=serve, timeout=timeout, wait_for_workers=False)
    except RuntimeError as error:
        if serve:
            raise StartupError(
                f"global rank 0 cannot listen on {address}: {error}. Another job (or an earlier run still "
                "shutting down) holds the port: stop it, or choose another MASTER_PORT on every node."
            ) from error
        raise StartupError(
            f"{node} cannot reach the master at {address} within {timeout}: {error}. "
            "Check that node 0 is running, that every node uses the same MASTER_ADDR and MASTER_PORT, and that "
            "the master's firewall lets this node reach that port."
        ) from error
    return PrefixStore(prefix, store) if prefix else store


def attempt_prefix() -> str | None:
    """Under torchrun every process is a client of the agent's store, which outlives a restart of the workers: a
    fresh prefix per attempt keeps the new workers from reading the dead ones' keys."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return f"attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
