#!/usr/bin/env bash
# Start this node's part of a DDP training job. Run the same command on every node; only NODE_RANK differs.
#
#   ./scripts/run_ddp_train.sh GPUS NODE_RANK [extra cli.py arguments...]
#
#   ./scripts/run_ddp_train.sh 0,1 0                           # on the master: GPUs 0 and 1, node rank 0
#   ./scripts/run_ddp_train.sh 0,1 1                           # on a worker:  GPUs 0 and 1, node rank 1
#   ./scripts/run_ddp_train.sh cpu:2 0 --trainer.max_epochs=3  # 2 CPU processes on gloo
#
# GPUS is a comma-separated list of GPU ids (it becomes CUDA_VISIBLE_DEVICES, one process per id)
# or cpu:N for N CPU processes. Cluster settings come from scripts/cluster.env; an environment
# variable of the same name overrides the file. Knobs read from the environment only:
#   CLUSTER_ENV=path    the settings file (default: scripts/cluster.env)
#   NUM_NODES=N         overrides trainer.num_nodes of the config (printed when used)
#   LAUNCHER=torchrun   start the processes with torchrun (c10d rendezvous) instead of Lightning
#   MAX_RESTARTS=3      with LAUNCHER=torchrun: how often torchrun restarts all workers after one fails
#   DEBUG=1             turn on PyTorch's and NCCL's distributed debugging output and NCCL trace dumps
#   DRY_RUN=1           print this node's environment and command, then exit
#   STOP_TIMEOUT=30     seconds between forwarding Ctrl-C/SIGTERM to training and killing it
#   PYTHON=python       the Python interpreter
set -euo pipefail

project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$project"

die() {
    printf 'error: %s\n' "$*" >&2
    exit 2
}

usage() {
    sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# KEY=value lines of the settings file, unless the environment sets KEY already.
load_settings() {
    local file=$1 line key number=0
    [[ -f $file ]] || die "settings file $file not found. Copy scripts/cluster.env there or point CLUSTER_ENV at it."
    while IFS= read -r line || [[ -n $line ]]; do
        number=$((number + 1))
        [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
        [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] \
            || die "$file:$number: expected KEY=value, got: $line"
        key=${BASH_REMATCH[1]}
        [[ -n ${!key+set} ]] || printf -v "$key" '%s' "${BASH_REMATCH[2]}"
        settings+=("$key")
    done <"$file"
}

require() {
    local key
    for key in "$@"; do
        [[ -n ${!key:-} ]] || die "$key is not set. Set it in $CLUSTER_ENV (the same on every node) or in the environment."
    done
}

resolve_ipv4() {
    if [[ $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        echo "$1"
    else
        getent ahostsv4 "$1" | awk '{ print $1; exit }'
    fi
}

# The interface that carries traffic to $1: the one holding it if it is local, else the one routing to it.
interface_to() {
    local route
    route=$(ip -o route get "$1" 2>/dev/null) || return 1
    if [[ $route == local* ]]; then
        ip -o addr show to "$1/32" | awk '{ print $2; exit }'
    else
        sed -n 's/.* dev \([^ ]*\).*/\1/p' <<<"$route"
    fi
}

# Who listens on TCP port $1 on this machine, as "name (pid N)", or empty if the port is free.
port_holder() {
    local line
    line=$(ss -Hltnp "sport = :$1" 2>/dev/null | head -n 1)
    [[ -n $line ]] || return 0
    if [[ $line =~ users:\(\(\"([^\"]+)\",pid=([0-9]+) ]]; then
        echo "${BASH_REMATCH[1]} (pid ${BASH_REMATCH[2]})"
    else
        echo "a process this user cannot see (sudo ss -ltnp 'sport = :$1' names it)"
    fi
}

wait_for_master() {
    local deadline=$((SECONDS + CONNECT_TIMEOUT))
    echo "node $NODE_RANK: waiting for the master at $MASTER_ADDR:$MASTER_PORT (up to ${CONNECT_TIMEOUT}s)"
    # shellcheck disable=SC2016  # $0 and $1 expand in the inner shell
    until timeout 3 bash -c ': <>"/dev/tcp/$0/$1"' "$master_ip" "$MASTER_PORT" 2>/dev/null; do
        if ((SECONDS >= deadline)); then
            printf 'error: node %s cannot reach the master at %s:%s after %ss. Check that node rank 0 is running (its log is %s/node0.log on the master), that MASTER_ADDR is its address on a network this node reaches (here it routes via %s: ip route get %s), and that MASTER_PORT is the same on every node and open in the master'"'"'s firewall (e.g. sudo ufw allow %s/tcp). Nothing was launched.\n' \
                "$NODE_RANK" "$MASTER_ADDR" "$MASTER_PORT" "$CONNECT_TIMEOUT" "$LOG_DIR" "$interface" "$master_ip" "$MASTER_PORT" >&2
            exit 1
        fi
        sleep 1
    done
}

# Every process started by this launch carries DDP_LAUNCH_ID in its environment, even the ones
# torchrun starts in sessions of their own or that outlive their parent.
# Words as a shell would need them, leaving plain ones (paths, 0,1, host:port) readable.
quote() {
    local word quoted=()
    for word in "$@"; do
        if [[ $word =~ ^[A-Za-z0-9_./:,=+@%-]+$ ]]; then
            quoted+=("$word")
        else
            quoted+=("$(printf '%q' "$word")")
        fi
    done
    echo "${quoted[*]}"
}

# shellcheck disable=SC2329  # called from traps
launch_processes() {
    grep -lxzF "DDP_LAUNCH_ID=$launch_id" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | paste -sd ' ' - || true
}

# Send signal $1 to the pids in $3, then SIGKILL whatever of this launch still runs after STOP_TIMEOUT.
# shellcheck disable=SC2329  # called from traps
stop_launch() {
    local signal=$1 why=$2 targets=$3 deadline pids
    [[ -n $targets ]] || return 0
    echo "node $NODE_RANK: $why: sending SIG$signal to $targets" >&2
    # shellcheck disable=SC2086  # one pid per word
    kill -s "$signal" $targets 2>/dev/null || true
    trap 'stop_launch KILL "interrupted again" "$(launch_processes)"' INT TERM
    deadline=$((SECONDS + STOP_TIMEOUT))
    while [[ -n $(launch_processes) ]] && ((SECONDS < deadline)); do
        sleep 0.5
    done
    pids=$(launch_processes)
    if [[ -n $pids ]]; then
        echo "node $NODE_RANK: still running after ${STOP_TIMEOUT}s: sending SIGKILL to $pids" >&2
        # shellcheck disable=SC2086
        kill -s KILL $pids 2>/dev/null || true
    fi
}

# The signal goes to the process this script started, which passes it on exactly once to the processes it
# started itself (Lightning's rank 0 to its local ranks, torchrun to its workers): Lightning's SIGTERM
# handling expects every rank to receive one SIGTERM, then checkpoints and stops them all together.
# shellcheck disable=SC2329  # called from traps
forward() {
    trapped=1
    stop_launch "$1" "$2" "$(kill -0 "$child" 2>/dev/null && echo "$child")"
}

# shellcheck disable=SC2329  # called from traps
on_exit() {
    stop_launch KILL "exiting" "$(launch_processes)"
    [[ -z ${fifo_dir:-} ]] || rm -rf "$fifo_dir"
}

(($# >= 2)) || usage
GPUS=$1
NODE_RANK=$2
shift 2

LAUNCHER=${LAUNCHER:-lightning}
MAX_RESTARTS=${MAX_RESTARTS:-3}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
PYTHON=${PYTHON:-python}
CLUSTER_ENV=${CLUSTER_ENV:-scripts/cluster.env}

if [[ $GPUS =~ ^cpu:([1-9][0-9]*)$ ]]; then
    procs_per_node=${BASH_REMATCH[1]}
    accelerator=cpu
    visible_devices=
elif [[ $GPUS =~ ^[0-9]+(,[0-9]+)*$ ]]; then
    IFS=, read -r -a gpu_ids <<<"$GPUS"
    procs_per_node=${#gpu_ids[@]}
    duplicates=$(printf '%s\n' "${gpu_ids[@]}" | sort -n | uniq -d | paste -sd, -)
    [[ -z $duplicates ]] || die "GPUS=$GPUS lists GPU $duplicates more than once. List each GPU id once, e.g. 0,1."
    accelerator=gpu
    visible_devices=$GPUS
else
    die "GPUS=$GPUS is neither a comma-separated list of GPU ids (e.g. 0,1) nor cpu:N (e.g. cpu:2)."
fi
[[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK=$NODE_RANK is not a non-negative integer. Use 0 on the master and 1, 2, ... on the workers."
NODE_RANK=$((10#$NODE_RANK))
[[ $LAUNCHER == lightning || $LAUNCHER == torchrun ]] || die "LAUNCHER=$LAUNCHER: use lightning (the default) or torchrun."
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS is not a non-negative integer."

settings=()
load_settings "$CLUSTER_ENV"
require MASTER_ADDR MASTER_PORT CONFIGS CONNECT_TIMEOUT LOG_DIR
if [[ ! $MASTER_PORT =~ ^[0-9]+$ ]] || ((MASTER_PORT < 1 || MASTER_PORT > 65535)); then
    die "MASTER_PORT=$MASTER_PORT is not a TCP port number (1-65535). Fix it in $CLUSTER_ENV."
fi
[[ $CONNECT_TIMEOUT =~ ^[0-9]+$ ]] || die "CONNECT_TIMEOUT=$CONNECT_TIMEOUT is not a number of seconds. Fix it in $CLUSTER_ENV."

config_args=()
read -r -a config_files <<<"${CONFIGS:?}"
for config in "${config_files[@]}"; do
    [[ -f $config ]] || die "config file $config (from CONFIGS in $CLUSTER_ENV) not found in $project. Fix the path; the same file must exist on every node."
    config_args+=(-c "$config")
done

cli_args=(fit "${config_args[@]}" "--trainer.accelerator=$accelerator" "--trainer.devices=$procs_per_node")
if [[ -n ${NUM_NODES:-} ]]; then
    [[ $NUM_NODES =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES=$NUM_NODES is not a positive integer."
    echo "NUM_NODES=$NUM_NODES from the environment overrides trainer.num_nodes of the config"
    cli_args+=("--trainer.num_nodes=$NUM_NODES")
fi
cli_args+=("$@")

# Parse the whole config now, so a mistake stops every node before anything starts.
resolved=$(CUDA_VISIBLE_DEVICES=$visible_devices "$PYTHON" cli.py "${cli_args[@]}" --print_config) \
    || die "the config above does not parse (cli.py ${cli_args[*]}). Nothing was launched."
num_nodes=$("$PYTHON" -c 'import sys, yaml; print(yaml.safe_load(sys.stdin)["trainer"]["num_nodes"])' <<<"$resolved")
((NODE_RANK < num_nodes)) \
    || die "NODE_RANK=$NODE_RANK is out of range: the config has trainer.num_nodes=$num_nodes, so node ranks are 0..$((num_nodes - 1)). Edit num_nodes in the config (or set NUM_NODES) on every node."

master_ip=$(resolve_ipv4 "$MASTER_ADDR")
[[ -n $master_ip ]] || die "MASTER_ADDR=$MASTER_ADDR does not resolve to an IPv4 address on this node. Use node 0's IP address."
interface=${SOCKET_IFNAME:-}
if [[ -z $interface ]]; then
    command -v ip >/dev/null || die "cannot find the network interface to MASTER_ADDR without the ip command. Install iproute2 or set SOCKET_IFNAME in $CLUSTER_ENV."
    interface=$(interface_to "$master_ip") && [[ -n $interface ]] \
        || die "no route from this node to MASTER_ADDR=$MASTER_ADDR ($master_ip). Check the address and this node's network (ip route get $master_ip), or set SOCKET_IFNAME in $CLUSTER_ENV."
fi

if ((NODE_RANK == 0)); then
    [[ $(ip -o route get "$master_ip" 2>/dev/null) == local* ]] \
        || die "node rank 0 must run on the master, but MASTER_ADDR=$MASTER_ADDR is not an address of this machine. Start rank 0 on $MASTER_ADDR, or set MASTER_ADDR to this machine's address on every node."
    holder=$(port_holder "$MASTER_PORT")
    [[ -z $holder ]] \
        || die "MASTER_PORT $MASTER_PORT is already in use on the master, by $holder, perhaps an earlier run still going. Stop it, or choose another free port as MASTER_PORT in $CLUSTER_ENV (the same on every node). Nothing was launched."
fi

# A stale LOCAL_RANK would make Lightning assume someone else started the processes (one per node, then a hang).
unset LOCAL_RANK RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK TORCHELASTIC_RUN_ID
export_keys=("${settings[@]}")
NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$interface}
GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$interface}
export CUDA_VISIBLE_DEVICES=$visible_devices # even when empty: cpu:N hides every GPU
export_keys+=(NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME CUDA_VISIBLE_DEVICES)

if [[ -n ${DEBUG:-} && $DEBUG != 0 ]]; then
    export TORCH_DISTRIBUTED_DEBUG=DETAIL
    export TORCH_CPP_LOG_LEVEL=INFO
    export TORCH_SHOW_CPP_STACKTRACES=1
    export NCCL_DEBUG=INFO
    # NCCL's flight recorder: on a collective timeout every rank dumps its last collectives to LOG_DIR.
    export TORCH_NCCL_DUMP_ON_TIMEOUT=1
    export TORCH_FR_BUFFER_SIZE=20000
    export TORCH_NCCL_TRACE_BUFFER_SIZE=$TORCH_FR_BUFFER_SIZE
    export TORCH_FR_DUMP_TEMP_FILE=$project/$LOG_DIR/nccl_trace_node${NODE_RANK}_rank_
    export TORCH_NCCL_DESYNC_DEBUG=1
    export_keys+=(TORCH_DISTRIBUTED_DEBUG TORCH_CPP_LOG_LEVEL TORCH_SHOW_CPP_STACKTRACES NCCL_DEBUG
        TORCH_NCCL_DUMP_ON_TIMEOUT TORCH_FR_BUFFER_SIZE TORCH_NCCL_TRACE_BUFFER_SIZE TORCH_FR_DUMP_TEMP_FILE
        TORCH_NCCL_DESYNC_DEBUG)
fi

if [[ $LAUNCHER == torchrun ]]; then
    # torchrun would set OMP_NUM_THREADS=1; share this node's cores among its processes instead.
    threads=$(($(nproc) / procs_per_node))
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}
    # torchrun keeps one TCPStore across restarts of the workers; the restarted ones would read the
    # addresses of the dead ones from it and fail with "Gloo connectFullMesh failed ... Connection refused".
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # torchrun's own log level: INFO shows the rendezvous and every restart of the workers.
    export LOGLEVEL=${LOGLEVEL:-INFO}
    export_keys+=(OMP_NUM_THREADS TORCH_DISABLE_SHARE_RDZV_TCP_STORE LOGLEVEL)
    command=("$PYTHON" -m torch.distributed.run
        "--nnodes=$num_nodes" "--nproc-per-node=$procs_per_node"
        --rdzv-backend=c10d "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" --rdzv-id=ddp
        "--rdzv-conf=join_timeout=$CONNECT_TIMEOUT" "--max-restarts=$MAX_RESTARTS"
        cli.py "${cli_args[@]}")
else
    export_keys+=(NODE_RANK)
    command=("$PYTHON" cli.py "${cli_args[@]}")
fi

declare -A seen=()
exports=()
for key in "${export_keys[@]}"; do
    [[ -z ${seen[$key]:-} ]] || continue
    seen[$key]=1
    if [[ $key == CUDA_VISIBLE_DEVICES || -n ${!key:-} ]]; then
        export "${key?}"
        exports+=("$key=${!key}")
    else
        unset "$key"
    fi
done

if [[ -n ${DRY_RUN:-} && $DRY_RUN != 0 ]]; then
    echo "# node $NODE_RANK of $num_nodes, $procs_per_node process(es) ($GPUS), launcher $LAUNCHER, in $project"
    echo "unset LOCAL_RANK RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK TORCHELASTIC_RUN_ID"
    for assignment in "${exports[@]}"; do
        echo "export ${assignment%%=*}=$(quote "${assignment#*=}")"
    done
    quote "${command[@]}"
    exit 0
fi

((NODE_RANK == 0)) || wait_for_master

mkdir -p "$LOG_DIR"
log_file=$LOG_DIR/node$NODE_RANK.log
launch_id="$(hostname)-$$-$(date +%s%N)"
{
    echo "==== $(date '+%F %T') node $NODE_RANK of $num_nodes, $procs_per_node process(es) ($GPUS), $LAUNCHER launcher"
    printf '%s\n' "${exports[@]}"
    quote "${command[@]}"
} | tee -a "$log_file"

trap on_exit EXIT
trap 'forward INT "interrupted, stopping training"' INT
trap 'forward TERM "terminated, stopping training"' TERM
fifo_dir=$(mktemp -d)
mkfifo "$fifo_dir/output"
tee -ia "$log_file" <"$fifo_dir/output" &
tee_pid=$!
# A session of its own: a Ctrl-C reaches training once, through the trap above.
setsid env "DDP_LAUNCH_ID=$launch_id" "${command[@]}" >"$fifo_dir/output" 2>&1 </dev/null &
child=$!

# A trapped signal ends `wait` early with 128+signal; wait again for the status training exited with.
trapped=1
while ((trapped)); do
    trapped=0
    status=0
    wait "$child" || status=$?
done
# Lightning's rank 0 may exit just before the ranks it started; give them time to finish. Orphans
# (say, of a killed torchrun) would keep training and hold the log pipe open: stop those.
deadline=$((SECONDS + STOP_TIMEOUT))
while [[ -n $(launch_processes) ]] && ((SECONDS < deadline)); do
    sleep 0.5
done
stop_launch TERM "training exited, stopping processes it left running" "$(launch_processes)"
wait "$tee_pid" || true
if ((status != 0)); then
    echo "node $NODE_RANK: training exited with status $status; its output is in $log_file" >&2
fi
exit "$status"
