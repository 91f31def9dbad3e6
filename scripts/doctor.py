"""The doctor's checks in Python, started on every node by scripts/doctor.sh once the network checks pass.

This node: versions, GPUs against the GPU list, /dev/shm (scripts/node_check.py). Then one process per device
joins the job's start-up handshake (the one training uses), so the master prints a row per process (with its
usable cores and threads) and names every difference; each node warns of more threads than cores (scripts/cpu_check.py);
the processes then form a process group with a short timeout and verify the collectives that data-parallel
training uses (scripts/collective_check.py), and optionally measure their bandwidth (scripts/comm_bench.py).
"""

import argparse
import contextlib
import importlib
import importlib.util
import io
import json
import os
import platform
import shlex
import socket
import sys
from datetime import timedelta
from pathlib import Path

import lightning
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import yaml
from torch.distributed import PrefixStore, TCPStore

from scripts import comm_bench, cpu_check
from scripts.collective_check import check_collectives
from scripts.node_check import check_node, say
from training.config import cli
from training.config.network import node_rank_problem
from training.job.fingerprint import code_digest, config_items, items_digest
from training.job.roster import Member, describe
from training.job.startup import StartupError, handshake, refuse

COLLECTIVE_TIMEOUT = timedelta(seconds=60)


def cpu_key(member: Member) -> str:
    return f"cpu/{member.host}/{member.pid}"


def print_roster(members: list[Member], cpus: list[dict]) -> None:
    rows = [
        {
            "rank": str(rank),
            "host": m.host,
            "node": str(m.node_rank),
            "local": str(m.local_rank),
            "device": m.device,
            "cores": cpu_check.ranges(cpu["cores"]),
            "threads": str(cpu["threads"]),
            "python": m.facts["python"],
            "torch": m.facts["torch"],
            "lightning": m.facts["lightning"],
            "code": m.facts["project code"],
            "config": items_digest(m.facts["config"]),
        }
        for rank, (m, cpu) in enumerate(zip(members, cpus, strict=True))
    ]
    table = [list(rows[0]), *(list(row.values()) for row in rows)]
    widths = [max(len(value) for value in column) for column in zip(*table, strict=True)]
    for row in table:
        print("  ".join(value.ljust(width) for value, width in zip(row, widths, strict=True)).rstrip(), flush=True)


def process(local_rank: int, args: argparse.Namespace, config: dict[str, str], warned) -> None:
    """One process of the job: check in, verify the collectives, measure if asked.

    Every process learns the same verdict; local rank 0 reports it and exits 1 on a problem, the others
    return, so the node's report is never cut short by a sibling's exit. ``warned`` is set when this node
    warned of something that does not stop training.
    """
    cpu_check.threads_like_training(args.nproc)
    rank, world = args.node_rank * args.nproc + local_rank, args.num_nodes * args.nproc
    if args.accelerator == "gpu":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        name = f"cuda:{local_rank} {torch.cuda.get_device_name(local_rank)}"
    else:
        device, name = torch.device("cpu"), "cpu"
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    timeout = timedelta(seconds=args.timeout)
    # The code a training run imports: the digest covers the modules of the config's classes too.
    for key, value in config.items():
        if key.endswith("class_path"):
            importlib.import_module(value.rpartition(".")[0])
    me = Member(
        node_rank=args.node_rank,
        local_rank=local_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        device=name,
        facts={
            "num_nodes": args.num_nodes,
            "devices per node": args.nproc,
            "python": platform.python_version(),
            "torch": torch.__version__,
            "lightning": lightning.__version__,
            "project code": code_digest(),
            "config": config,
        },
    )
    try:
        store = TCPStore(address, port, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
        store.set(cpu_key(me), json.dumps(cpu_check.usage()))
        roster = handshake(
            store,
            me,
            num_nodes=args.num_nodes,
            devices=args.nproc,
            timeout=timeout,
            address=f"{address}:{port}",
            leader=rank == 0,
            fail_fast=False,
        )
    except (StartupError, RuntimeError) as error:
        if local_rank == 0:
            say("FAIL", str(error))
            sys.exit(1)
        return
    if rank == 0:
        print_roster(roster.members, [json.loads(store.get(cpu_key(m))) for m in roster.members])
    if roster.problems:
        if local_rank == 0:
            say("FAIL", describe(roster))
            sys.exit(1)
        return
    if local_rank == 0:
        say("ok", f"all {world} processes of {args.num_nodes} node(s) joined and agree on versions, code and config")
        node = [
            {**json.loads(store.get(cpu_key(m))), "rank": rank}
            for rank, m in enumerate(roster.members)
            if m.node_rank == args.node_rank
        ]
        for warning in cpu_check.warnings(f"node {args.node_rank} ({me.host})", node):
            say("WARN", warning)
            warned.set()

    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        store=PrefixStore("doctor", store),
        rank=rank,
        world_size=world,
        timeout=COLLECTIVE_TIMEOUT,
        device_id=device if device.type == "cuda" else None,
    )
    problems = check_collectives(rank, world, device)
    everyone: list[dict[str, str]] = [{} for _ in range(world)]
    dist.all_gather_object(everyone, problems)
    failed = False
    if local_rank == 0:
        for name in problems:
            wrong = [p[name] for p in everyone if p.get(name)]
            failed |= bool(wrong)
            detail = ": " + "; ".join(wrong) if wrong else ""
            say("FAIL" if wrong else "ok", f"{name} on {world} processes ({backend}){detail}")
    if args.bench and not any(any(p.values()) for p in everyone):
        rows = comm_bench.run(args.bench_max_mb << 20, device)
        if rank == 0:
            print(comm_bench.table(rows), flush=True)
            title = f"{backend}, {world} processes on {args.num_nodes} node(s)"
            for path in comm_bench.write(rows, Path(args.out_dir), title):
                say("ok", f"wrote {path}")
    # Every rank's collectives finished (gloo's barrier waits for them) before the group goes: destroyed while its
    # worker thread still frees one, the group's destructor would wait for that thread, which needs the GIL this
    # process holds, and the process would hang on its way out.
    dist.barrier()
    dist.destroy_process_group()
    if failed:
        sys.exit(1)


def resolved_config(cli_args: list[str]) -> dict:
    """The config training gets from ``cli_args``, as ``python cli.py ARGS --print_config`` prints it; exits with the
    problem where it does not parse. Parsed in this process rather than in a Python of its own: its processes, forked
    on CPU, then hold what training imports too."""
    printed, argv = io.StringIO(), sys.argv
    sys.argv = ["cli.py", *cli_args, "--print_config"]  # as cli.py's messages name the command
    try:
        with contextlib.redirect_stdout(printed):
            cli.main()
    except SystemExit as exit_:
        if exit_.code:
            say("FAIL", f"the config above does not parse (cli.py {shlex.join(cli_args)}). Nothing was joined.")
            sys.exit(2)
    finally:
        sys.argv = argv
    return yaml.safe_load(printed.getvalue())


def stop_the_other_nodes(args: argparse.Namespace, why: str) -> None:
    """Give the processes of the other nodes, which wait for the master's word in the start-up handshake, ``why``
    as its verdict: they stop with it at once, rather than wait out the timeout for a master that stopped."""
    others = (args.num_nodes - 1) * args.nproc
    timeout = timedelta(seconds=args.timeout)
    print(f"      telling the {others} processes of the other nodes (waiting up to {args.timeout:g} s)", flush=True)
    address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = TCPStore(address, port, is_master=True, timeout=timeout, wait_for_workers=False)
    refuse(store, why, others, timeout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--node-rank", type=int, required=True)
    parser.add_argument("--nproc", type=int, required=True, help="processes (devices) on this node")
    parser.add_argument("--accelerator", choices=("cpu", "gpu"), required=True)
    parser.add_argument("--gpus", required=True, help="the launcher's GPUS argument, as given")
    parser.add_argument("--timeout", type=float, required=True, help="seconds the master waits for every process")
    parser.add_argument("--out-dir", required=True, help="where the benchmark's files go")
    parser.add_argument("--bench", action="store_true", help="measure collective bandwidth as well")
    parser.add_argument("--bench-max-mb", type=int, default=64, help="largest message of the benchmark, in MiB")
    parser.add_argument("cli_args", nargs="+", help="after --: the arguments training gives cli.py")
    args = parser.parse_args()
    resolved = resolved_config(args.cli_args)
    if problem := node_rank_problem(resolved):
        say("FAIL", problem)
        sys.exit(2)
    args.num_nodes = resolved["trainer"]["num_nodes"]  # the job's, as training gets it
    say("ok", f"node {args.node_rank} of {args.num_nodes}: {args.nproc} process(es) ({args.gpus}), config parsed")
    if args.bench and args.node_rank == 0 and importlib.util.find_spec("matplotlib") is None:
        why = "BENCH=1: the master plots comm_bench.png with matplotlib, which is not installed here"
        say("FAIL", f"{why}: pip install -r requirements-charts.txt, or leave BENCH unset. Nothing was measured.")
        if args.num_nodes > 1:
            why = why.replace("here", f"on node 0 ({socket.gethostname()})")
            fix = "pip install -r requirements-charts.txt there, or leave BENCH unset on every node"
            stop_the_other_nodes(args, f"node 0 stopped the doctor before the processes joined: {why}: {fix}.")
        sys.exit(2)

    healthy = check_node(args)
    if args.accelerator == "gpu" and not torch.cuda.is_available():
        sys.exit(1)
    config = config_items(resolved)
    # GPU processes start afresh: CUDA, which check_node has set up here, does not survive a fork. On CPU a forked
    # process skips the seconds of importing torch again.
    start_method = "spawn" if args.accelerator == "gpu" else "fork"
    warned = mp.get_context(start_method).Event()
    try:
        mp.start_processes(process, args=(args, config, warned), nprocs=args.nproc, start_method=start_method)
    except mp.ProcessExitedException:
        healthy = False
    if not healthy:
        say("FAIL", "the doctor found problems above")
    elif warned.is_set():
        say("ok", "the doctor found nothing that stops training, but see the warnings above")
    else:
        say("ok", "the doctor found nothing wrong")
    sys.exit(0 if healthy else 1)


if __name__ == "__main__":
    main()
