# shellcheck shell=bash
# What scripts/run_ddp_train.sh and scripts/doctor.sh share: their arguments (GPUS NODE_RANK [cli.py
# arguments...]), scripts/cluster.env, the resolved config, and the checks of the network to the master.
# Sourced, not run; the caller has `set -euo pipefail` and has cd'ed to the project root.

die() {
    printf 'error: %s\n' "$*" >&2
    exit 2
}

usage() {
    sed -n '2,/^[^#]/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2
    exit 2
}

# KEY=value lines of the settings file, unless the environment sets KEY already (listed in from_environment).
load_settings() {
    local file=$1 line key number=0
    [[ -f $file ]] || die "settings file $file not found. Copy scripts/cluster.env there or point CLUSTER_ENV at it."
    while IFS= read -r line || [[ -n $line ]]; do
        number=$((number + 1))
        [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
        [[ $line =~ ^([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] \
            || die "$file:$number: expected KEY=value, got: $line"
        key=${BASH_REMATCH[1]}
        if [[ -n ${!key+set} ]]; then
            from_environment+=("$key=${!key}")
        else
            printf -v "$key" '%s' "${BASH_REMATCH[2]}"
        fi
        settings+=("$key")
    done <"$file"
}

require() {
    local key
    for key in "$@"; do
        [[ -n ${!key:-} ]] || die "$key is not set. Set it in $CLUSTER_ENV (the same on every node) or in the environment."
    done
}

# The IPv4 address of host name or address $1; empty (and status 0) when it does not resolve, so that a caller's
# `x=$(resolve_ipv4 ...)` under `set -e` goes on to say so rather than exit silently with getent's status.
resolve_ipv4() {
    if [[ $1 =~ ^[0-9]+\.[0-9]+\.[0-9]+\.[0-9]+$ ]]; then
        echo "$1"
    else
        { getent ahostsv4 "$1" || true; } | awk '{ print $1; exit }'
    fi
}

# How this machine reaches IPv4 address $1, as "local|remote SOURCE INTERFACE": SOURCE is the address packets to it
# leave from, INTERFACE the one holding $1 if it is local, else the one routing to it. Status 1: no route. Stock GPU,
# cluster and container images often lack iproute2: without ip, Python's sockets and the kernel answer instead.
route_to() {
    local route
    if ! command -v ip >/dev/null; then
        "$PYTHON" -m scripts.network route "$1"
        return
    fi
    route=$(ip -o route get "$1" 2>/dev/null) || return 1
    [[ $route =~ \ dev\ ([^ ]+).*\ src\ ([^ ]+) ]] || return 1
    if [[ $route == local* ]]; then
        # The route to an address of this machine goes through lo: name the interface that holds the address.
        echo "local ${BASH_REMATCH[2]} $(ip -o addr show to "$1/32" | awk -v dev="${BASH_REMATCH[1]}" '{ dev = $2; exit } END { print dev }')"
    else
        echo "remote ${BASH_REMATCH[2]} ${BASH_REMATCH[1]}"
    fi
}

# Who listens on TCP port $1 on this machine, as "name (pid N)", or empty if the port is free.
port_holder() {
    local line
    if ! command -v ss >/dev/null; then
        "$PYTHON" -m scripts.network listener "$1"
        return
    fi
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

# One entry of a GPU list as CUDA_VISIBLE_DEVICES takes it: an index, a GPU or MIG UUID as nvidia-smi -L shows it
# (or enough of its beginning to be unique), or the older MIG-GPU-<uuid>/<gpu instance>/<compute instance>.
# CUDA silently drops an entry it cannot read and every entry after it: the launcher lets nothing else through.
gpu_id='([0-9]+|(GPU|MIG)-[0-9a-fA-F]+(-[0-9a-fA-F]+)*|MIG-GPU-[0-9a-fA-F]+(-[0-9a-fA-F]+)*/[0-9]+/[0-9]+)'
gpu_list="^$gpu_id(,$gpu_id)*\$"

# The entries of the comma-separated list $1 that occur more than once, comma-separated.
repeated() {
    tr , '\n' <<<"$1" | awk 'seen[$0]++ == 1' | paste -sd, -
}

# With a CUDA_VISIBLE_DEVICES set before the launcher started ($inherited: a job scheduler's GPUs for this job,
# or the user's), the GPUs "$@" of GPUS are picked from it, as CUDA would: an index is a position in that list,
# a UUID must be one of its entries. Sets visible_devices.
pick_inherited_gpus() {
    local id available picked=() set_by="set before the launcher started (by a job scheduler or in your shell)"
    [[ $inherited =~ $gpu_list && -z $(repeated "$inherited") ]] \
        || die "CUDA_VISIBLE_DEVICES=$inherited, $set_by, is not a comma-separated list of distinct GPU ids or UUIDs, so GPUS=$GPUS cannot pick GPUs from it. Unset CUDA_VISIBLE_DEVICES to name GPUs by their nvidia-smi ids, fix it to the GPUs this job may use, or train on CPU with cpu:N. Nothing was launched."
    IFS=, read -r -a available <<<"$inherited"
    for id in "$@"; do
        if [[ $id =~ ^[0-9]+$ ]]; then
            ((10#$id < ${#available[@]})) \
                || die "GPUS=$GPUS asks for GPU $id, but CUDA_VISIBLE_DEVICES=$inherited, $set_by, holds ${#available[@]} GPU(s). Under an inherited CUDA_VISIBLE_DEVICES the ids in GPUS are positions in that list (GPUS=0 means GPU ${available[0]}), so use ids 0..$((${#available[@]} - 1)), or unset CUDA_VISIBLE_DEVICES to name GPUs by their nvidia-smi ids. Nothing was launched."
            picked+=("${available[10#$id]}")
        else
            [[ ,$inherited, == *",$id,"* ]] \
                || die "GPUS=$GPUS names $id, which CUDA_VISIBLE_DEVICES=$inherited, $set_by, does not list: this job may use only the GPUs listed there. Name them by position in that list (GPUS=0 means GPU ${available[0]}) or as listed, or unset CUDA_VISIBLE_DEVICES to name any GPU of this node. Nothing was launched."
            picked+=("$id")
        fi
    done
    visible_devices=$(IFS=, && echo "${picked[*]}")
    [[ -z $(repeated "$visible_devices") ]] \
        || die "GPUS=$GPUS names GPU $(repeated "$visible_devices") twice, by its position in CUDA_VISIBLE_DEVICES=$inherited and as listed there. Name each GPU once."
    echo "GPUS=$GPUS picks from CUDA_VISIBLE_DEVICES=$inherited, $set_by: training uses $visible_devices"
}

# The syntax of GPUS, the same on every node. Sets procs_per_node, accelerator and gpu_ids.
parse_gpus() {
    gpu_ids=()
    if [[ $GPUS =~ ^cpu:([1-9][0-9]*)$ ]]; then
        procs_per_node=${BASH_REMATCH[1]}
        accelerator=cpu
    elif [[ $GPUS =~ $gpu_list ]]; then
        local duplicates
        IFS=, read -r -a gpu_ids <<<"$GPUS"
        procs_per_node=${#gpu_ids[@]}
        duplicates=$(repeated "$GPUS")
        [[ -z $duplicates ]] || die "GPUS=$GPUS lists GPU $duplicates more than once. List each GPU id once, e.g. 0,1."
        accelerator=gpu
    else
        die "GPUS=$GPUS is neither a comma-separated list of GPU ids (e.g. 0,1) or UUIDs (GPU-..., MIG-..., as nvidia-smi -L shows them) nor cpu:N (e.g. cpu:2)."
    fi
}

# Validate GPUS NODE_RANK [cli.py arguments...], the settings and the network to the master, in bash alone (the
# config's parse imports Lightning); stop with the problem and its fix before anything starts. Sets GPUS,
# NODE_RANK, procs_per_node, accelerator, visible_devices, settings, cli_args, master_ip, interface, master_side
# (local on the master) and source_ip (this node's address towards the master).
validate_node() {
    (($# >= 2)) || usage
    GPUS=$1
    NODE_RANK=$2
    shift 2
    PYTHON=${PYTHON:-python}
    # First: a Python or package release the template does not support stops here, naming the one to install.
    "$PYTHON" -m training.job.versions || exit 2
    CLUSTER_ENV=${CLUSTER_ENV:-scripts/cluster.env}

    local inherited=${CUDA_VISIBLE_DEVICES:-}
    parse_gpus
    visible_devices=
    if [[ $accelerator == gpu ]]; then
        visible_devices=$GPUS
        [[ -z $inherited ]] || pick_inherited_gpus "${gpu_ids[@]}"
    fi
    [[ $NODE_RANK =~ ^[0-9]+$ ]] || die "NODE_RANK=$NODE_RANK is not a non-negative integer. Use 0 on the master and 1, 2, ... on the workers."
    NODE_RANK=$((10#$NODE_RANK))

    settings=()
    from_environment=()
    load_settings "$CLUSTER_ENV"
    MASTER_ADDR=${MASTER_ADDR:-127.0.0.1} # this machine alone; scripts/launch_cluster.sh passes the master's address
    require MASTER_PORT CONFIGS CONNECT_TIMEOUT LOG_DIR
    if [[ ! $MASTER_PORT =~ ^[0-9]+$ ]] || ((MASTER_PORT < 1 || MASTER_PORT > 65535)); then
        die "MASTER_PORT=$MASTER_PORT is not a TCP port number (1-65535). Fix it in $CLUSTER_ENV."
    fi
    [[ $CONNECT_TIMEOUT =~ ^[0-9]+$ ]] || die "CONNECT_TIMEOUT=$CONNECT_TIMEOUT is not a number of seconds. Fix it in $CLUSTER_ENV."

    local config config_files config_args=()
    read -r -a config_files <<<"$CONFIGS"
    for config in "${config_files[@]}"; do
        [[ -f $config ]] || die "config file $config (from CONFIGS in $CLUSTER_ENV) not found in $PWD. Fix the path; the same file must exist on every node."
        config_args+=(-c "$config")
    done

    cli_args=(fit "${config_args[@]}" "--trainer.accelerator=$accelerator" "--trainer.devices=$procs_per_node")
    if [[ -n ${NUM_NODES:-} ]]; then
        [[ $NUM_NODES =~ ^[1-9][0-9]*$ ]] || die "NUM_NODES=$NUM_NODES is not a positive integer."
        ((NODE_RANK < NUM_NODES)) \
            || die "NODE_RANK=$NODE_RANK is out of range: NUM_NODES=$NUM_NODES, so node ranks are 0..$((NUM_NODES - 1)). Set NUM_NODES to the number of nodes, the same on every node."
        echo "NUM_NODES=$NUM_NODES from the environment overrides trainer.num_nodes of the config"
        cli_args+=("--trainer.num_nodes=$NUM_NODES")
    fi
    cli_args+=("$@")

    master_ip=$(resolve_ipv4 "$MASTER_ADDR")
    [[ -n $master_ip ]] || die "MASTER_ADDR=$MASTER_ADDR does not resolve to an IPv4 address on this node (getent ahostsv4 $MASTER_ADDR finds none). Check its spelling, or set MASTER_ADDR to node 0's IP address, the same on every node. Nothing was launched."
    interface=${SOCKET_IFNAME:-}
    [[ -z $interface || $interface =~ ^[^,^=[:space:]]+(,[^,^=[:space:]]+)*$ ]] \
        || die "SOCKET_IFNAME=$interface is not an interface name (or a comma-separated list of them). It sets the interface of both NCCL and gloo, and gloo takes names only: name the interface (e.g. eth0). For NCCL's patterns (^docker excludes, a plain name matches as a prefix), set NCCL_SOCKET_IFNAME itself, and GLOO_SOCKET_IFNAME to the interface."
    local master_route=() route_interface
    read -r -a master_route <<<"$(route_to "$master_ip" || true)"
    # shellcheck disable=SC2034  # source_ip is for run_ddp_train.sh
    master_side=${master_route[0]:-} source_ip=${master_route[1]:-} route_interface=${master_route[2]:-}
    if [[ -z $interface ]]; then
        interface=$route_interface
        [[ -n $interface ]] \
            || die "no route from this node to MASTER_ADDR=$MASTER_ADDR ($master_ip). Check the address and this node's network (ip route get $master_ip), or set SOCKET_IFNAME in $CLUSTER_ENV."
    fi

    if ((NODE_RANK == 0)); then
        local holder
        [[ $master_side == local ]] \
            || die "node rank 0 must run on the master, but MASTER_ADDR=$MASTER_ADDR is not an address of this machine. Start rank 0 on $MASTER_ADDR, or set MASTER_ADDR to this machine's address on every node."
        holder=$(port_holder "$MASTER_PORT")
        [[ -z $holder ]] \
            || die "MASTER_PORT $MASTER_PORT is already in use on the master, by $holder, perhaps an earlier run still going. Stop it, or choose another free port as MASTER_PORT in $CLUSTER_ENV (the same on every node). Nothing was launched."
    fi
}

# Parse the whole config in a process of its own, for torchrun's rendezvous, which needs its values before training
# starts. Sets resolved (the config as YAML), num_nodes and min_nodes (the strategy's, empty when
# unset).
parse_config() {
    resolved=$(CUDA_VISIBLE_DEVICES=$visible_devices "$PYTHON" cli.py "${cli_args[@]}" --print_config) \
        || die "the config above does not parse (cli.py ${cli_args[*]}). Nothing was launched."
    # shellcheck disable=SC2034  # min_nodes is for run_ddp_train.sh
    read -r num_nodes min_nodes < <("$PYTHON" -c '
import sys, yaml
trainer = yaml.safe_load(sys.stdin)["trainer"]
strategy = trainer["strategy"] if isinstance(trainer["strategy"], dict) else {}
print(trainer["num_nodes"], (strategy.get("init_args") or {}).get("min_nodes") or "")' <<<"$resolved")
    ((NODE_RANK < num_nodes)) \
        || die "NODE_RANK=$NODE_RANK is out of range: the config has trainer.num_nodes=$num_nodes, so node ranks are 0..$((num_nodes - 1)). Edit num_nodes in the config (or set NUM_NODES) on every node."
}

# Name what every process of this node needs (the settings, the interface for NCCL and gloo, the GPUs)
# in export_keys, for apply_exports, and drop what would mislead it.
export_node_environment() {
    # A stale LOCAL_RANK would make Lightning assume someone else started the processes (one per node, then a hang).
    unset LOCAL_RANK RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK TORCHELASTIC_RUN_ID
    # NCCL takes a plain name as a prefix (eth0 would match eth01 and eth0.100 too); "=" means exactly these
    # interfaces. gloo knows no prefixes or patterns, only names.
    NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-=$interface}
    GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$interface}
    export CUDA_VISIBLE_DEVICES=$visible_devices # even when empty: cpu:N hides every GPU
    # CUDA numbers the GPUs fastest first, nvidia-smi (whose ids GPUS takes) by PCI bus: have CUDA count the same way.
    CUDA_DEVICE_ORDER=${CUDA_DEVICE_ORDER:-PCI_BUS_ID}
    export_keys=("${settings[@]}" MASTER_ADDR NCCL_SOCKET_IFNAME GLOO_SOCKET_IFNAME CUDA_VISIBLE_DEVICES CUDA_DEVICE_ORDER)
}

# Export every name in export_keys that has a value (an empty setting means "not set") and list the
# assignments, once each, in exports.
apply_exports() {
    local key
    local -A seen=()
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
}
