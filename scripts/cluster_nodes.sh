# shellcheck shell=bash
# What scripts/launch_cluster.sh does with the hosts: read the hostfile, check every host before anything starts,
# then start a node on each over ssh, watch them and stop them. Sourced after scripts/common.sh, not run.

# Set by read_hostfile: the hosts as ssh reaches them and their addresses (without user@), in node order. Set by
# scripts/launch_cluster.sh: the environment and cli.py arguments of every node, and the ssh options.
hosts=() addresses=() node_env=() cli_args=() ssh_options=()
# A node has this long after its stop request to end and close its connection, on top of its STOP_TIMEOUT.
stop_margin=30

# Messages while nodes run: a closed terminal must not end the launcher before the nodes have stopped.
tell() {
    printf '%s\n' "$*" || true
}

say() {
    printf '%s\n' "$*" >&2 || true
}

# One word as any POSIX shell reads it: the remote command goes through the login shell of each host.
single_quote() {
    printf "'%s'" "${1//\'/\'\\\'\'}"
}

read_hostfile() {
    hostfile=$1
    local line words number=0 address
    local -A line_of=()
    [[ -f $hostfile && -r $hostfile ]] || die "hostfile $hostfile not found. Write one host per line (host or user@host), node 0 first."
    while IFS= read -r line || [[ -n $line ]]; do
        number=$((number + 1))
        read -r -a words <<<"${line%%#*}"
        ((${#words[@]} > 0)) || continue
        [[ ${#words[@]} == 1 && ${words[0]} =~ ^([A-Za-z_][A-Za-z0-9._-]*@)?([A-Za-z0-9][A-Za-z0-9.-]*)$ ]] \
            || die "$hostfile:$number: expected one host as ssh reaches it (host-a, 10.0.0.2 or user@host-a), got: $line. Every host runs the GPUs of GPUS, the launcher's second argument, so a hostfile has no slot or GPU counts."
        address=${BASH_REMATCH[2]}
        [[ -z ${line_of[$address]:-} ]] \
            || die "$hostfile:$number: $address is listed again (first on line ${line_of[$address]}). List each host once: every host runs one node with the GPUs of GPUS."
        line_of[$address]=$number
        hosts+=("${words[0]}")
        addresses+=("$address")
    done <"$hostfile"
    ((${#hosts[@]} > 0)) || die "hostfile $hostfile lists no host. Write one host per line (host or user@host), node 0 first."
}

# The command node $1's ssh runs: run_ddp_train.sh in the project directory, with the environment every node
# shares and the assignments after $1 added to it.
node_command() {
    local rank=$1
    shift
    echo "cd $(quote "$PROJECT_DIR") && exec env $(quote "${node_env[@]}" "$@") ./scripts/run_ddp_train.sh $(quote "$GPUS" "$rank" "${cli_args[@]}")"
}

# What the check of node $1 runs over ssh: each problem has an exit status of its own. The checks of
# run_ddp_train.sh come when it starts; a node that fails them stops the others at once.
check_command() {
    # Their installed versions, read without importing them (seconds of CPU on every host).
    local rank=$1 versions='from importlib.metadata import version; print("versions:", version("torch"), version("lightning"))'
    printf '%s; ' "cd $(quote "$PROJECT_DIR") 2>/dev/null || exit 90" "test -f scripts/run_ddp_train.sh || exit 91" \
        "$(quote "${PYTHON:-python}") -c $(single_quote "$versions") || exit 92"
    # What MASTER_ADDR is on the master itself: Debian and Ubuntu map a machine's own name to 127.0.1.1.
    if ((rank == 0 && NUM_NODES > 1)); then
        # shellcheck disable=SC2016  # expands on the master
        printf 'echo master-address: $(getent ahostsv4 %s | head -n 1)' "$(quote "$MASTER_ADDR")"
    fi
}

# The last line of $1, without the carriage return ssh ends its own messages with.
last_line() {
    tail -n 1 <<<"$1" | tr -d '\r'
}

# Check every host at once; name every problem, and start nothing if there is one.
check_hosts() {
    local i status out where versions=() master problems=() pids=()
    check_dir=$(mktemp -d)
    trap 'rm -rf "$check_dir"' EXIT
    echo "checking $NUM_NODES host(s) over ssh: the project in $PROJECT_DIR, torch and Lightning"
    for i in "${!hosts[@]}"; do
        # shellcheck disable=SC2029  # the command is built here
        ssh "${ssh_options[@]}" "${hosts[i]}" "$(check_command "$i")" </dev/null >"$check_dir/$i" 2>&1 &
        pids[i]=$!
    done
    for i in "${!hosts[@]}"; do
        status=0
        wait "${pids[i]}" || status=$?
        out=$(<"$check_dir/$i")
        where="${addresses[i]} (node $i)"
        case $status in
            0) ;;
            255) problems+=("cannot reach $where over ssh: $(last_line "$out"). Check that ssh $(quote "${ssh_options[@]}") ${hosts[i]} true logs in without a password or a question (the launcher never answers one): install a key (ssh-copy-id ${hosts[i]}), accept the host key once, or fix $hostfile.") ;;
            90 | 91) problems+=("$where has no copy of this project in $PROJECT_DIR$( ((status == 90)) || echo " (no scripts/run_ddp_train.sh)"). Put the project there (the same commit as here), or set PROJECT_DIR to where it is on every host.") ;;
            92) problems+=("on $where, ${PYTHON:-python} does not have torch and lightning installed: $(last_line "$out"). Install requirements.txt there, or set PYTHON to the Python that has them (a command run over ssh activates no virtual environment: PYTHON=/path/to/venv/bin/python).") ;;
            *) problems+=("checking $where failed with status $status: $(last_line "$out")") ;;
        esac
        ((status == 0)) || continue
        versions[i]=$(sed -n 's/^versions: //p' <<<"$out")
        if ((i > 0)) && [[ -n ${versions[0]:-} && ${versions[i]} != "${versions[0]}" ]]; then
            problems+=("$where has torch ${versions[i]% *} and Lightning ${versions[i]#* }, node 0 (${addresses[0]}) torch ${versions[0]% *} and Lightning ${versions[0]#* }. Install the same versions on every host (pip install -r requirements.txt of the same commit), or set PYTHON to a Python that has them.")
        fi
        master=$(sed -n 's/^master-address: \([^ ]*\).*/\1/p' <<<"$out")
        if [[ $master == 127.* ]]; then
            problems+=("MASTER_ADDR=$MASTER_ADDR is $master on the master, ${addresses[0]}: a loopback address, which the other hosts cannot reach (Debian and Ubuntu map a machine's own name to 127.0.1.1 in /etc/hosts). Write node 0's address on the network the hosts share as the first line of $hostfile, or set MASTER_ADDR to it in scripts/cluster.env.")
        fi
    done
    rm -rf "$check_dir"
    trap - EXIT
    if ((${#problems[@]} > 0)); then
        printf 'error: %s\n' "${problems[@]}" >&2
        say "Nothing was started."
        exit 2
    fi
    echo "every host is ready: torch ${versions[0]% *}, Lightning ${versions[0]#* }"
}

# Start a node on every host and wait for them all; exit with the first failing node's status, or 128+signal.
run_nodes() {
    local i host
    open_pipes
    alive=() retry_at=() retry_timers=() signalled='' first_failed='' failed_status='' deadline='' timer='' printed=$(mktemp -d) markers=()
    trap stop_timer EXIT
    trap 'stop_nodes INT 130 interrupted' INT
    trap 'stop_nodes TERM 143 terminated' TERM
    trap 'stop_nodes TERM 129 "the terminal closed"' HUP
    echo "starting $NUM_NODES node(s): ${addresses[*]}"
    for i in "${!hosts[@]}"; do
        [[ -n $signalled ]] || start_node "$i"
    done
    while [[ -n ${!alive[*]} ]]; do
        wait -n || true # until an ssh or a timer ends, or a signal arrives
        collect_finished_nodes
        retry_nodes
        if [[ -n $deadline ]] && ((SECONDS >= deadline)); then
            kill_stragglers
        fi
    done
    stop_timer
    wait_for_output
    if [[ -n $signalled ]]; then
        exit "$signalled"
    elif [[ -n $first_failed ]]; then
        host=${addresses[first_failed]}
        say "error: node $first_failed ($host) failed first, with status $failed_status: see its lines above ([node $first_failed $host] ...) and, once its training had started, $PROJECT_DIR/$LOG_DIR/node$first_failed.log on $host."
        exit "$failed_status"
    fi
    tell "every node finished"
}

# Each node reads its input from a pipe whose only writer is this script: writing INT or TERM asks the node to stop
# (STOP_WITH_STDIN of run_ddp_train.sh). However this script ends, SIGKILL included, the kernel closes the pipe, ssh
# passes the end of input on, and the node stops as on SIGTERM. Nothing here must outlive the script for that, as a
# watchdog process would, and nothing on a node polls: sshd signals nothing when a connection without a terminal
# closes, but the end of input always arrives. A closed terminal or connection to this machine sends SIGHUP first.
open_pipes() {
    local i writer reader dir
    dir=$(mktemp -d)
    to_node=() from_launcher=() pipes=()
    for i in "${!hosts[@]}"; do
        mkfifo "$dir/node$i"
        # shellcheck disable=SC2094  # both ends of one pipe
        exec {writer}<>"$dir/node$i" {reader}<"$dir/node$i"
        rm "$dir/node$i"
        to_node[i]=$writer
        from_launcher[i]=$reader
        pipes+=("$writer" "$reader")
    done
    rmdir "$dir"
}

# The writing end of every pipe stays with this script alone, or a node would never see its end.
close_pipes() {
    local fd
    for fd in "${pipes[@]}"; do
        exec {fd}>&-
    done
}

# Start node $1: run_ddp_train.sh over ssh, reading the pipe from this script, every line it prints prefixed.
start_node() {
    local i=$1 command
    command=$(node_command "$i" STOP_WITH_STDIN=1)
    # A marker per start: a node started again prints after its first start's output has ended.
    markers+=("$printed/${#markers[@]}")
    (
        exec <&"${from_launcher[i]}"
        close_pipes
        # A session of its own: a Ctrl-C reaches this script alone, which asks every node to stop, and ssh keeps
        # carrying what the nodes print while they stop.
        # shellcheck disable=SC2029  # the command is built here
        exec setsid ssh "${ssh_options[@]}" "${hosts[i]}" "$command"
    ) > >(prefix_lines "[node $i ${addresses[i]}] " "${markers[-1]}") 2>&1 &
    ssh_pids[i]=$!
    alive[i]=1
}

# The prefix $1 goes before every line and every redraw of a progress bar (a carriage return); file $2 is made once
# the node's last line is printed.
prefix_lines() {
    close_pipes
    trap '' INT # this script passes a Ctrl-C on to the nodes; what they print while stopping still shows
    PREFIX=$1 awk '{
        line_end = sub(/\r$/, "") ? "\r" : ""
        gsub(/\r/, "\r" ENVIRON["PREFIX"])
        printf "%s%s%s\n", ENVIRON["PREFIX"], $0, line_end
        fflush()
    }'
    : >"$2"
}

# The nodes' lines are printed by processes of their own, which may still be at it when the nodes have ended: the
# launcher's last line comes after theirs (at most 30 s: a process a node left behind may hold its output open).
wait_for_output() {
    local marker end=$((SECONDS + 30))
    for marker in "${markers[@]}"; do
        while [[ ! -e $marker ]] && ((SECONDS < end)); do
            sleep 0.1
        done
    done
    rm -rf "$printed"
}

# Ask every running node to stop as on signal $1, and exit with $2 once they have; $3 says why.
stop_nodes() {
    signalled=${signalled:-$2}
    say "$3: sending SIG$1 to every node (killed if still running ${STOP_TIMEOUT}s later; again: at once)"
    ask_nodes "$1"
}

ask_nodes() {
    local i
    for i in "${!alive[@]}"; do
        printf '%s\n' "$1" >&"${to_node[i]}"
    done
    [[ -z $deadline ]] || return 0
    deadline=$((SECONDS + STOP_TIMEOUT + stop_margin))
    (
        close_pipes
        trap '' INT HUP # it must outlive a Ctrl-C, or nothing would end the wait for a host that stopped answering
        exec sleep "$((STOP_TIMEOUT + stop_margin))"
    ) &
    timer=$!
}

stop_timer() {
    [[ -z $timer ]] || kill "$timer" 2>/dev/null || true
    [[ -z ${retry_timers[*]} ]] || kill "${retry_timers[@]}" 2>/dev/null || true
}

# Note the status of every node whose ssh has ended; the first failure stops the others.
collect_finished_nodes() {
    local i status
    for i in "${!alive[@]}"; do
        ! kill -0 "${ssh_pids[i]}" 2>/dev/null || continue
        unset "alive[i]"
        status=0
        wait "${ssh_pids[i]}" || status=$?
        if ((status == 0)); then
            tell "node $i (${addresses[i]}) finished"
        elif [[ -n ${MIN_NODES:-} && -z $signalled && -n ${alive[0]:-} ]]; then
            # torchrun goes on with the other nodes; the node joins again at the next restart once it runs.
            say "node $i (${addresses[i]}) failed with status $status: the elastic job goes on without it (MIN_NODES=$MIN_NODES); starting it again every ${ELASTIC_WAIT}s while node 0 runs"
            retry_at[i]=$((SECONDS + ELASTIC_WAIT))
            (
                close_pipes
                exec sleep "$ELASTIC_WAIT"
            ) &
            retry_timers+=("$!")
        elif [[ -z $first_failed ]]; then
            first_failed=$i
            failed_status=$status
            [[ -z $signalled ]] || continue
            ((status != 255)) || status="255 (ssh's own: the connection failed or was lost)"
            if [[ -z ${!alive[*]} ]]; then
                say "node $i (${addresses[i]}) failed with status $status"
                continue
            fi
            say "node $i (${addresses[i]}) failed with status $status: stopping the other nodes with SIGTERM (killed if still running ${STOP_TIMEOUT}s later)"
            ask_nodes TERM
        fi
    done
}

# Start again the nodes of an elastic job that failed, once their time has come; none once node 0 has ended.
retry_nodes() {
    local i
    for i in "${!retry_at[@]}"; do
        if [[ -z ${alive[0]:-} || -n $signalled ]]; then
            say "node $i (${addresses[i]}) is not started again: the job has ended"
            unset "retry_at[i]"
        elif ((SECONDS >= retry_at[i])); then
            unset "retry_at[i]"
            say "starting node $i (${addresses[i]}) again"
            start_node "$i"
        fi
    done
}

# An ssh still running long after its node was asked to stop: the host stopped answering.
kill_stragglers() {
    local i
    for i in "${!alive[@]}"; do
        say "node $i (${addresses[i]}) has not ended ${STOP_TIMEOUT}s + ${stop_margin}s after the stop: killing its ssh (pid ${ssh_pids[i]}); the node stops training when it sees the connection closed"
        kill -s KILL "${ssh_pids[i]}" 2>/dev/null || true
    done
    deadline=''
}
