"""The node's place in the job and the network interface gloo is told to use, from the environment, checked before
anything starts: Lightning reads ``NODE_RANK`` and torch ``GLOO_SOCKET_IFNAME`` only as every process joins the job,
where a node rank past the last node waits for a node that never comes, and an interface this machine lacks ends in
a traceback from each process."""

import os
import socket
from typing import Any

from training.config.trainer_settings import runs_on_cpu


def node_rank_problem(settings: dict[str, Any]) -> str | None:
    """The paragraph when ``NODE_RANK`` (scripts/run_ddp_train.sh sets it, Lightning reads it) is not a node of the job
    of ``settings`` (a subcommand's config, a dict), or None. torchrun numbers its nodes itself."""
    given = os.environ.get("NODE_RANK")
    if given is None or "TORCHELASTIC_RUN_ID" in os.environ:
        return None
    num_nodes = (settings.get("trainer") or {}).get("num_nodes", 1)
    if given.isdigit() and int(given) < num_nodes:
        return None
    wrong = "is out of range" if given.isdigit() else "is not a node rank"
    return (
        f"NODE_RANK={given} {wrong}: the config has trainer.num_nodes={num_nodes}, so node ranks are "
        f"0..{num_nodes - 1}. Edit num_nodes in the config (or set NUM_NODES for scripts/run_ddp_train.sh) on every "
        "node, or give this node its rank in that range. Nothing was started."
    )


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
