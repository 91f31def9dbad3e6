#!/usr/bin/env bash
# Check a DDP job before training it: run on every node the same way as scripts/run_ddp_train.sh.
#
#   ./scripts/doctor.sh GPUS NODE_RANK [extra cli.py arguments...]
#
#   ./scripts/doctor.sh 0,1 0            # on the master
#   ./scripts/doctor.sh 0,1 1            # on a worker
#   BENCH=1 ./scripts/doctor.sh 0,1 0    # also measure collective bandwidth (all nodes need BENCH=1)
#
# Same arguments and scripts/cluster.env as the launcher. It checks this node (versions, GPUs against
# the GPU list, /dev/shm, the interface to MASTER_ADDR, MASTER_PORT free on the master or reachable from
# a worker), then joins every process of the job for a moment: the master prints a table with a row per
# process and names every difference in versions, code and config; all verify broadcast, scatter, gather,
# reduce, all_gather, all_reduce and send/recv. Exit status 0 only when everything holds.
# Knobs read from the environment (besides those of scripts/run_ddp_train.sh):
#   BENCH=1             measure all_reduce, all_gather and broadcast over message sizes; writes
#                       comm_bench.{csv,json,png} to LOG_DIR/doctor on the master
#   BENCH_MAX_MB=64     the largest message of the benchmark, in MiB
#   DOCTOR_TIMEOUT=N    seconds the master waits for every process (default: CONNECT_TIMEOUT)
[ -n "${BASH_VERSION:-}" ] || {
    echo "error: $0 is a bash script; run it as $0 or with bash, not sh." >&2
    exit 2
}
set -euo pipefail

project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$project"
# shellcheck source=common.sh
source scripts/common.sh

validate_node "$@"
export_node_environment
export_keys+=(NODE_RANK) # as training has it, for the config's check of the node rank
apply_exports

echo "ok    network interface $interface (NCCL_SOCKET_IFNAME=$NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME=$GLOO_SOCKET_IFNAME)"
if ((NODE_RANK == 0)); then
    echo "ok    MASTER_ADDR $MASTER_ADDR is this machine and MASTER_PORT $MASTER_PORT is free"
else
    wait_for_master
    echo "ok    the master at $MASTER_ADDR:$MASTER_PORT is reachable"
fi

# The doctor parses the config itself (as training will: scripts/run_ddp_train.sh's arguments), in its own process.
options=(--node-rank "$NODE_RANK" --nproc "$procs_per_node" --accelerator "$accelerator" --gpus "$GPUS"
    --timeout "${DOCTOR_TIMEOUT:-$CONNECT_TIMEOUT}" --out-dir "$LOG_DIR/doctor" --bench-max-mb "${BENCH_MAX_MB:-64}")
if [[ -n ${BENCH:-} && $BENCH != 0 ]]; then
    options+=(--bench)
fi
"$PYTHON" -m scripts.doctor "${options[@]}" -- "${cli_args[@]}"
