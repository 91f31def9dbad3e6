"""The network interface gloo is told to use, checked before anything starts: torch reads ``GLOO_SOCKET_IFNAME`` only
as every process creates the process group, and an interface this machine lacks ends there in a traceback from
each of them."""

import os
import socket
from typing import Any

from training.config.trainer_settings import runs_on_cpu


def gloo_interface_problem(settings: dict[str, Any]) -> str | None:
    """The paragraph when ``GLOO_SOCKET_IFNAME`` names an interface this machine lacks and the job of ``settings`` (a
    subcommand's config, a dict) runs on gloo, or None."""
    given = os.environ.get("GLOO_SOCKET_IFNAME")
    trainer = settings.get("trainer") or {}
    strategy = trainer.get("strategy")
    backend = ((strategy.get("init_args") or {}) if isinstance(strategy, dict) else {}).get("process_group_backend")
    if not given or not (backend == "gloo" or (backend is None and runs_on_cpu(trainer))):
        return None
    here = [name for _, name in socket.if_nameindex()]
    missing = [name for name in given.split(",") if name not in here]  # gloo takes a comma-separated list
    if not missing:
        return None
    return (
        f"GLOO_SOCKET_IFNAME={given} is set in the environment, but this machine ({socket.gethostname()}) has no "
        f"network interface named {' or '.join(missing)}; it has {', '.join(here)}. gloo carries the job's "
        "traffic over that interface and cannot start without it: unset GLOO_SOCKET_IFNAME, or name the interface of "
        "the network the nodes share (ip -br addr lists them; scripts/run_ddp_train.sh sets it from SOCKET_IFNAME "
        "or the route to MASTER_ADDR). Nothing was started."
    )
