#!/usr/bin/env bash
# Start a DDP job on every machine of a hostfile from this one: scripts/run_ddp_train.sh on each, over ssh.
#
#   ./scripts/launch_cluster.sh HOSTFILE GPUS [extra cli.py arguments...]
#
#   ./scripts/launch_cluster.sh hosts 0,1                           # GPUs 0 and 1 on every host
#   ./scripts/launch_cluster.sh hosts cpu:2 --trainer.max_epochs=3  # 2 CPU processes per host, on gloo
#   DRY_RUN=1 ./scripts/launch_cluster.sh hosts 0,1                 # print each node's ssh command
#
# HOSTFILE has one host per line as ssh reaches it, host or user@host (# starts a comment; blank lines are
# skipped). The first is node 0, the master: MASTER_ADDR is its address unless scripts/cluster.env or the
# environment sets one. NUM_NODES is the number of hosts; GPUS, as run_ddp_train.sh takes it, is the same on every
# host. Each host needs the project in the same directory as here and ssh from here without a password or a
# question. Before anything starts, every host is checked: ssh reaches it, the project directory is there, torch
# and Lightning have node 0's versions (then each node makes run_ddp_train.sh's checks). Output lines are
# prefixed with their node ([node 1 host-b] ...) and land in each node's own log as well. When a node fails, or
# on Ctrl-C or SIGTERM, every other node is stopped as run_ddp_train.sh stops training (a second Ctrl-C kills at
# once); the exit status is the first failing node's. An elastic job (LAUNCHER=torchrun MIN_NODES=N) goes on
# when a node other than node 0 fails: that node is started again every ELASTIC_WAIT seconds (30) while node 0
# runs, and joins the job at its next restart. Every node gets PYTHON, RUN_ID, CLUSTER_ENV, LAUNCHER,
# MAX_RESTARTS, MIN_NODES, ELASTIC_WAIT, DEBUG and STOP_TIMEOUT where they are set, and every setting of cluster.env as this machine has it.
# Knobs read from the environment:
#   PROJECT_DIR=path    the project directory on every host (default: this one's)
#   SSH_OPTS="-i $HOME/.ssh/cluster -p 2222"   more ssh options, split at spaces
#   STOP_TIMEOUT=30     seconds a node has to stop training before it is killed
#   DRY_RUN=1           print each node's ssh command and connect to nothing
[ -n "${BASH_VERSION:-}" ] || {
    echo "error: $0 is a bash script; run it as $0 or with bash, not sh." >&2
    exit 2
}
set -euo pipefail

project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# shellcheck source=common.sh
source "$project/scripts/common.sh"
# shellcheck source=cluster_nodes.sh
source "$project/scripts/cluster_nodes.sh"

(($# >= 2)) || usage
GPUS=$2
read_hostfile "$1" # before the cd below: the path is the caller's
shift 2
cli_args=("$@")
cd "$project"
parse_gpus
PROJECT_DIR=${PROJECT_DIR:-$project}
[[ $PROJECT_DIR == /* ]] || die "PROJECT_DIR=$PROJECT_DIR is not an absolute path. Give the project's directory on every host from /, e.g. PROJECT_DIR=$project."
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
[[ $STOP_TIMEOUT =~ ^[0-9]+$ ]] || die "STOP_TIMEOUT=$STOP_TIMEOUT is not a number of seconds."
settings=()
load_settings "${CLUSTER_ENV:-scripts/cluster.env}"
[[ -z ${NUM_NODES:-} || $NUM_NODES == "${#hosts[@]}" ]] \
    || die "NUM_NODES=$NUM_NODES is set, but $hostfile lists ${#hosts[@]} host(s) and the launcher starts one node on each. Unset NUM_NODES, or list $NUM_NODES hosts."
NUM_NODES=${#hosts[@]}
MASTER_ADDR=${MASTER_ADDR:-${addresses[0]}}
ELASTIC_WAIT=${ELASTIC_WAIT:-30}
[[ $ELASTIC_WAIT =~ ^[0-9]+$ ]] || die "ELASTIC_WAIT=$ELASTIC_WAIT is not a number of seconds."

declare -A passed=()
for key in "${settings[@]}" MASTER_ADDR NUM_NODES STOP_TIMEOUT PYTHON RUN_ID CLUSTER_ENV LAUNCHER MAX_RESTARTS MIN_NODES ELASTIC_WAIT DEBUG; do
    [[ -n ${!key+set} && -z ${passed[$key]:-} ]] || continue
    passed[$key]=1
    node_env+=("$key=${!key}")
done
read -r -a user_ssh_options <<<"${SSH_OPTS:-}"
# ssh keeps the first value it reads for an option: BatchMode (never a question) comes before the user's options,
# the other defaults after them. -T last: a node reads the launcher's requests from its input, not a terminal.
ssh_options=(-o BatchMode=yes "${user_ssh_options[@]}" -o ConnectTimeout=20 -o ServerAliveInterval=15
    -o ServerAliveCountMax=4 -T)

if [[ -n ${DRY_RUN:-} && $DRY_RUN != 0 ]]; then
    echo "# $NUM_NODES node(s) from $hostfile, $procs_per_node process(es) each ($GPUS), MASTER_ADDR=$MASTER_ADDR"
    for i in "${!hosts[@]}"; do
        echo "# node $i"
        echo "$(quote ssh "${ssh_options[@]}" "${hosts[i]}") $(single_quote "$(node_command "$i" STOP_WITH_STDIN=1)")"
    done
    exit 0
fi

check_hosts
run_nodes
