#!/usr/bin/env bash
# Start this node's part of a DDP training job. Run the same command on every node; only NODE_RANK differs.
#
#   ./scripts/run_ddp_train.sh GPUS NODE_RANK [extra cli.py arguments...]
#
#   ./scripts/run_ddp_train.sh 0,1 0                           # on the master: GPUs 0 and 1, node rank 0
#   ./scripts/run_ddp_train.sh 0,1 1                           # on a worker:  GPUs 0 and 1, node rank 1
#   ./scripts/run_ddp_train.sh cpu:2 0 --trainer.max_epochs=3  # 2 CPU processes on gloo
#
# GPUS is a comma-separated list of GPU ids or UUIDs as nvidia-smi -L shows them (it becomes
# CUDA_VISIBLE_DEVICES, one process per id; CUDA_DEVICE_ORDER=PCI_BUS_ID unless set, so CUDA counts as
# nvidia-smi does) or cpu:N for N CPU processes. Where CUDA_VISIBLE_DEVICES is already set, say by a job
# scheduler, GPUS picks from it by position and never leaves it:
#   CUDA_VISIBLE_DEVICES=2,3 ./scripts/run_ddp_train.sh 0,1 0    # trains on GPUs 2 and 3; GPUS=1 means GPU 3
# Cluster settings come from scripts/cluster.env; an environment variable of the same name overrides the
# file. Knobs read from the environment only:
#   CLUSTER_ENV=path    the settings file (default: scripts/cluster.env)
#   NUM_NODES=N         overrides trainer.num_nodes of the config (printed when used)
#   LAUNCHER=torchrun   start the processes with torchrun (c10d rendezvous) instead of Lightning
#   MAX_RESTARTS=3      with LAUNCHER=torchrun: how often torchrun restarts all workers after one fails
#   MIN_NODES=N         with LAUNCHER=torchrun: an elastic job of MIN_NODES to NUM_NODES nodes, which goes on
#                       with the nodes it has after it lost one (overrides strategy min_nodes of the config)
#   ELASTIC_WAIT=30     with MIN_NODES: seconds the rendezvous waits for more nodes once MIN_NODES are there
#   DEBUG=1             turn on PyTorch's and NCCL's distributed debugging output and NCCL trace dumps
#   DRY_RUN=1           print this node's environment and command, then exit (scripts/doctor.sh checks the config)
#   STOP_TIMEOUT=30     seconds between forwarding Ctrl-C/SIGTERM/SIGHUP to training and killing it
#   FROZEN_TIMEOUT=300  seconds training may stay stopped (SIGSTOP, a debugger gone) before it is killed; 0: never
#   DETACH=1            run this node in the background, on after its terminal or ssh session closes: its output
#                       goes to logs/nodes/node<N>.log only, and the line printed says how to follow and stop it
#   STOP_WITH_STDIN=1   a line INT or TERM on standard input acts as that signal, and its end as SIGTERM
#                       (scripts/launch_cluster.sh sets it: a node stops when its ssh connection closes)
#   PYTHON=python       the Python interpreter
[ -n "${BASH_VERSION:-}" ] || {
    echo "error: $0 is a bash script; run it as $0 or with bash, not sh." >&2
    exit 2
}
set -euo pipefail

project=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$project"
# shellcheck source=common.sh
source scripts/common.sh

# Every process started by this launch carries DDP_LAUNCH_ID in its environment, even the ones
# torchrun starts in sessions of their own or that outlive their parent.
# shellcheck disable=SC2329  # called from traps
launch_processes() {
    grep -lxzF "DDP_LAUNCH_ID=$launch_id" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | paste -sd ' ' - || true
}

# A line of this script's own: on a line of its own after a progress bar's, on the terminal and in the node's log.
# shellcheck disable=SC2329  # called from traps
say() {
    printf '\n%s\n' "$*" >&"$terminal"
    printf '\n%s\n' "$*" >>"$log_file" 2>/dev/null || true
}

# Send signal $1 to the pids in $3, then SIGKILL whatever of this launch still runs after STOP_TIMEOUT.
# shellcheck disable=SC2329  # called from traps
stop_launch() {
    local signal=$1 why=$2 targets=$3 deadline pids
    [[ -n $targets ]] || return 0
    say "node $NODE_RANK: $why: sending SIG$signal to $targets"
    # shellcheck disable=SC2086  # one pid per word
    kill -s "$signal" $targets 2>/dev/null || true
    trap 'stop_at_once INT' INT
    trap 'stop_at_once TERM' TERM
    trap '' HUP # a closed terminal may send it twice: from the shell, and as its last process leaves it
    deadline=$((SECONDS + STOP_TIMEOUT))
    while [[ -n $(launch_processes) ]] && ((SECONDS < deadline)); do
        sleep 0.5
    done
    pids=$(launch_processes)
    if [[ -n $pids ]]; then
        say "node $NODE_RANK: still running after ${STOP_TIMEOUT}s: sending SIGKILL to $pids"
        # shellcheck disable=SC2086
        kill -s KILL $pids 2>/dev/null || true
    fi
}

# A second Ctrl-C or SIGTERM ($1) while training stops: end it now, as a second Ctrl-C to python cli.py does, and exit
# as that signal.
# shellcheck disable=SC2329  # called from traps
stop_at_once() {
    stop_launch KILL "interrupted again" "$(launch_processes)"
    say "error: node $NODE_RANK was stopped at once: nothing more was saved. Run the same command again to resume" \
        "from the run's last checkpoint."
    exit $((128 + $(kill -l "$1")))
}

# The signal goes to the process this script started, which passes it on exactly once to the processes it
# started itself (Lightning's rank 0 to its local ranks, torchrun to its workers): Lightning's SIGTERM
# handling expects every rank to receive one SIGTERM, then checkpoints and stops them all together.
# shellcheck disable=SC2329  # called from traps
forward() {
    trapped=1
    stop_launch "$1" "$2" "$(kill -0 "$child" 2>/dev/null && echo "$child")"
}

# The terminal closed: training saves and stops as on Ctrl-C, and this script's own words go to the node's log only, as
# training's do (tee writes on to the log after the terminal is gone).
# shellcheck disable=SC2329  # called from traps
hung_up() {
    exec >/dev/null 2>&1 {terminal}>/dev/null
    forward HUP "the terminal closed, stopping training"
}

# The disk of the node's log filled while training runs: tee stops writing the log, and training goes on with its
# output shown only here (DETACH=1 shows it nowhere). Said once, in place of tee's own line.
# shellcheck disable=SC2329  # runs in the background
log_failed() {
    local line
    trap '' INT TERM HUP # a stop signal to every process of the launcher: what tee says still reaches the terminal
    while IFS= read -r line; do
        if [[ $line != "tee: $log_file: "* ]]; then # not about the log (the terminal closed, say): as tee said it
            printf '%s\n' "$line" >&2
            continue
        fi
        # On a line of its own, after a progress bar's.
        printf '\nwarning: node %s cannot write its log %s any more (%s): training goes on, its output from here on %s\n' \
            "$NODE_RANK" "$log_file" "${line##*: }" \
            "shows only here. Free space on that disk, or set LOG_DIR to another for the next run." >&2
    done
}

# With STOP_WITH_STDIN, standard input comes from whoever started this node over ssh (scripts/launch_cluster.sh):
# a line INT or TERM asks for a stop as that signal does, and its end, which arrives however the starter ended
# (SIGKILL included) or its connection closed, stops training as SIGTERM does. sshd signals nothing when a
# connection without a terminal closes: without this, a node would train on with nobody to stop it.
# shellcheck disable=SC2329  # runs in the background
follow_stdin() {
    local line
    while IFS= read -r line; do
        [[ $line != INT && $line != TERM ]] || ! started_by_this_script || kill -s "$line" "$$"
    done
    ! started_by_this_script || kill -s TERM "$$"
}

# Whether the process calling this is still this script's child: once the script has exited, its pid may be
# another process's.
# shellcheck disable=SC2329  # called from follow_stdin
started_by_this_script() {
    local stat parent
    read -r stat <"/proc/$BASHPID/stat"
    read -r _ parent _ <<<"${stat##*) }"
    [[ $parent == "$$" ]]
}

# shellcheck disable=SC2329  # called from traps
stop_following() {
    [[ -z ${stdin_follower:-} ]] || kill "$stdin_follower" 2>/dev/null || true
}

# A training process stopped for good (SIGSTOP, a debugger that went away) never ends, and every other node stops
# after peer_timeout: end it once it has been stopped for FROZEN_TIMEOUT seconds, so that this command does not wait
# forever. (A node's other processes end a stopped local rank 0 sooner; Ctrl-Z here stops this script with it.)
# shellcheck disable=SC2329  # runs in the background
watch_frozen() {
    local since="" stat tick
    # Nothing writes to this fifo: reading it with a timeout waits a second without starting a process, which (as
    # `sleep 1` would) could outlive this watch and the launcher by up to a second.
    mkfifo "$fifo_dir/tick"
    exec {tick}<>"$fifo_dir/tick"
    while ! read -rt 1 -u "$tick" && { read -r stat <"/proc/$child/stat"; } 2>/dev/null; do
        stat=${stat##*) }
        if [[ ${stat%% *} != [Tt] ]]; then
            since=""
        elif ((SECONDS - ${since:=$SECONDS} >= FROZEN_TIMEOUT)); then
            kill -s KILL "$child" 2>/dev/null || true
            say "node $NODE_RANK: training (pid $child) had been stopped for ${FROZEN_TIMEOUT}s: killed it"
            return
        fi
    done
}

# shellcheck disable=SC2329  # called from traps
on_exit() {
    [[ -z ${frozen_watch:-} ]] || kill "$frozen_watch" 2>/dev/null || true
    stop_following
    stop_launch KILL "exiting" "$(launch_processes)"
    [[ -z ${fifo_dir:-} ]] || rm -rf "$fifo_dir"
}

# The knobs this node took from the environment, for the command that resumes the job (below).
knobs=()
for key in CLUSTER_ENV NUM_NODES MIN_NODES ELASTIC_WAIT LAUNCHER MAX_RESTARTS RUN_ID PYTHON; do
    [[ -z ${!key:-} ]] || knobs+=("$key=${!key}")
done
LAUNCHER=${LAUNCHER:-lightning}
MAX_RESTARTS=${MAX_RESTARTS:-3}
STOP_TIMEOUT=${STOP_TIMEOUT:-30}
FROZEN_TIMEOUT=${FROZEN_TIMEOUT:-300}
[[ $FROZEN_TIMEOUT =~ ^[0-9]+$ ]] || die "FROZEN_TIMEOUT=$FROZEN_TIMEOUT is not a number of seconds."
[[ $LAUNCHER == lightning || $LAUNCHER == torchrun ]] || die "LAUNCHER=$LAUNCHER: use lightning (the default) or torchrun."
[[ $MAX_RESTARTS =~ ^[0-9]+$ ]] || die "MAX_RESTARTS=$MAX_RESTARTS is not a non-negative integer."
ELASTIC_WAIT=${ELASTIC_WAIT:-30}
[[ $ELASTIC_WAIT =~ ^[0-9]+$ ]] || die "ELASTIC_WAIT=$ELASTIC_WAIT is not a number of seconds."
if [[ -n ${STOP_WITH_STDIN:-} && $STOP_WITH_STDIN != 0 ]]; then
    follow_stdin <&0 >/dev/null 2>&1 &
    stdin_follower=$!
    trap stop_following EXIT
fi
validate_node "$@"
if [[ -n ${MIN_NODES:-} ]]; then
    [[ $MIN_NODES =~ ^[1-9][0-9]*$ ]] || die "MIN_NODES=$MIN_NODES is not a positive integer."
    [[ $LAUNCHER == torchrun ]] \
        || die "MIN_NODES=$MIN_NODES asks for an elastic job, which needs torchrun's rendezvous: set LAUNCHER=torchrun too, on every node (Lightning's launcher starts a fixed number of nodes)."
    echo "MIN_NODES=$MIN_NODES from the environment overrides strategy min_nodes of the config"
    cli_args+=("--trainer.strategy.init_args.min_nodes=$MIN_NODES")
fi
dry_run=0
[[ -z ${DRY_RUN:-} || $DRY_RUN == 0 ]] || dry_run=1
# Before anything imports Lightning: torch alone tells whether this node has the GPUs.
if [[ $accelerator == gpu ]] && ((!dry_run)); then
    CUDA_VISIBLE_DEVICES=$visible_devices "$PYTHON" -m scripts.gpu_check "$procs_per_node" || exit 2
fi
# Lightning's launcher: training parses and checks the config first thing, before it waits for any other node, so a
# mistake stops every node at once without a parse of its own here, which would import Lightning once more on every
# start. torchrun's rendezvous needs the config's num_nodes and min_nodes.
if [[ $LAUNCHER == torchrun ]]; then
    parse_config
    nodes=$num_nodes
    [[ -z $min_nodes ]] || nodes=$min_nodes:$num_nodes
else
    nodes=${NUM_NODES:-"the config's trainer.num_nodes"}
fi
export_node_environment
# Training names this command, with the environment it depends on, as the one that resumes the job after it lost
# a node: the same on every node but for the node rank.
launch_command=$(quote "${from_environment[@]}" "${knobs[@]}" "$0" "$@")

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
    # torchrun names each node by this address to the others (by default, by its host name, which may resolve to
    # another interface) and numbers the nodes in the order of these addresses. Node 0 hosts the rendezvous:
    # torchrun would guess so only where MASTER_ADDR is the address its host name resolves to.
    rendezvous_conf=join_timeout=$CONNECT_TIMEOUT,is_host=$( ((NODE_RANK == 0)) && echo true || echo false)
    [[ $nodes != *:* ]] || rendezvous_conf+=,last_call_timeout=$ELASTIC_WAIT
    rendezvous=("--nnodes=$nodes" "--local-addr=$source_ip" "--rdzv-conf=$rendezvous_conf")
    command=("$PYTHON" -m torch.distributed.run "${rendezvous[@]}" "--nproc-per-node=$procs_per_node"
        --rdzv-backend=c10d "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT" --rdzv-id=ddp "--max-restarts=$MAX_RESTARTS"
        cli.py "${cli_args[@]}")
else
    export_keys+=(NODE_RANK)
    command=("$PYTHON" cli.py "${cli_args[@]}")
fi

apply_exports

if ((dry_run)); then
    echo "# node $NODE_RANK of $nodes, $procs_per_node process(es) ($GPUS), launcher $LAUNCHER, in $project"
    echo "unset LOCAL_RANK RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK TORCHELASTIC_RUN_ID"
    for assignment in "${exports[@]}"; do
        echo "export ${assignment%%=*}=$(quote "${assignment#*=}")"
    done
    quote "${command[@]}"
    exit 0
fi

log_file=$LOG_DIR/node$NODE_RANK.log
if [[ -n ${DETACH:-} && $DETACH != 0 ]]; then
    mkdir -p "$LOG_DIR"
    # A session of its own, without a terminal: nothing it closes reaches it. SIGINT restored, as for training below.
    (trap - INT && exec setsid env DETACH=0 "$project/scripts/run_ddp_train.sh" "$@") </dev/null >/dev/null 2>>"$log_file" &
    [[ $log_file == /* ]] || log_file=$project/$log_file
    echo "node $NODE_RANK runs in the background as pid $!, on after this terminal closes. Follow it:" \
        "tail -f $log_file. Stop it, with last.ckpt saved: kill -INT $!"
    exit 0
fi

# Lightning's launcher: training waits for the master itself (CONNECT_TIMEOUT), once it has checked the config.
[[ $LAUNCHER != torchrun ]] || ((NODE_RANK == 0)) || wait_for_master

mkdir -p "$LOG_DIR"
launch_id="$(hostname)-$$-$(date +%s%N)"
started=$(date '+%F %T') # once: the terminal and the log show the same header
header() {
    echo "==== $started node $NODE_RANK of $nodes, $procs_per_node process(es) ($GPUS), $LAUNCHER launcher"
    printf '%s\n' "${exports[@]}"
    quote "${command[@]}"
}
header
if ! failure=$(header 2>&1 >>"$log_file"); then
    die "node $NODE_RANK cannot write its log $log_file (${failure##*: }). Free space on that disk, or set LOG_DIR" \
        "(scripts/cluster.env or the environment) to a directory on another. Nothing was launched."
fi

exec {terminal}>&2 # where say() writes while this script's stderr goes nowhere
trap on_exit EXIT
trap 'forward INT "interrupted, stopping training"' INT
trap 'forward TERM "terminated, stopping training"' TERM
trap hung_up HUP
fifo_dir=$(mktemp -d)
mkfifo "$fifo_dir/output"
# A stop signal to every process of this script (kill -TERM -PGID, a terminal's Ctrl-C) leaves tee to write what
# training says as it stops; tee ends once training has.
(trap '' HUP INT TERM && exec tee -a "$log_file" 2> >(log_failed)) <"$fifo_dir/output" &
tee_pid=$!
# A session of its own: a Ctrl-C reaches training once, through the trap above. A script starts its
# background commands with SIGINT ignored, which Python keeps: restore it, or training never sees the Ctrl-C.
# training.job.launched sends training SIGTERM once this script ends, even by SIGKILL.
(trap - INT && exec setsid env "DDP_LAUNCH_ID=$launch_id" "LAUNCH_COMMAND=$launch_command" "DDP_NODE_LOG=$log_file" \
    "$PYTHON" -m training.job.launched "$$" "${command[@]}") >"$fifo_dir/output" 2>&1 </dev/null &
child=$!
if ((FROZEN_TIMEOUT > 0)); then
    watch_frozen &
    frozen_watch=$!
fi

# A trapped signal ends `wait` early with 128+signal; wait again for the status training exited with.
trapped=1
while ((trapped)); do
    trapped=0
    status=0
    # Bash's own line on a process killed by a signal, printed as it reaps one, goes nowhere: say() tells.
    { wait "$child" || status=$?; } 2>/dev/null
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
    say "node $NODE_RANK: training exited with status $status; its output is in $log_file"
fi
exit "$status"
