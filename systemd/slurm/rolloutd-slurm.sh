#!/usr/bin/env bash
# rolloutd on a Slurm allocation: the head daemons (events, router, gateway) on the first node
# of the allocation, init/run/eval on every node, tcp:// between nodes and ipc:// within one.
#
#   rolloutd-slurm.sh launch   inside an allocation (the sbatch script, or salloc): one srun step
#                              (named rolloutd-nodes) with one task per node, each running
#                              `rolloutd-slurm.sh node`. On SIGTERM/SIGINT/SIGHUP it asks every
#                              node to stop in order (SIGUSR1 to that step, see stop_step).
#   rolloutd-slurm.sh node     one node's daemons (what srun runs); restarts a daemon that dies
#                              (backoff 1..30 s). On SIGUSR1/SIGTERM/SIGINT/SIGHUP it stops them in
#                              pipeline order (init, run, eval, gateway, router, events), each
#                              within ROLLOUTD_DRAIN_S + 5 s before SIGKILL, and removes its files.
#                              (When Slurm itself ends the job, e.g. scancel or the time limit
#                              without --signal, every process gets SIGTERM at once and each
#                              daemon drains on its own; set KillWait above drain_s + 5 s.)
#   rolloutd-slurm.sh env      print the derived head and endpoints, then exit.
#
# Environment (all optional):
#   ROLLOUTD_BIN          rolloutd executable (default: rolloutd on PATH)
#   ROLLOUTD_CONFIG       base TOML config, readable on every node; the launcher overrides node,
#                         endpoints.head, endpoints.base_port, endpoints.runtime_dir (and keys_dir)
#   ROLLOUTD_BASE_PORT    first of the six head ports (default 5550): gateway, gateway_results,
#                         init, router, events_in, events_out
#   ROLLOUTD_HEAD_ADDR    address the nodes reach the head at (default: the head node's NodeAddr
#                         from `scontrol show node`, else its host name)
#   ROLLOUTD_KEYS_DIR     CURVE keys (`rolloutd keys generate`), readable on every node
#   ROLLOUTD_RUNTIME_DIR  node-local directory for the ipc sockets
#                         (default ${TMPDIR:-/tmp}/rolloutd-$SLURM_JOB_ID)
#   ROLLOUTD_INFO_FILE    JSON written by the head node once its daemons are started: gateway and
#                         events addresses, head, nodes (default $SLURM_SUBMIT_DIR/rolloutd-$SLURM_JOB_ID.json)
#   ROLLOUTD_DRAIN_S      daemon.drain_s for every daemon (default: the config's, 10 s)
#   ROLLOUTD_SET          extra space-separated SECTION.KEY=VALUE overrides for every daemon
#   ROLLOUTD_RESTART      1 (default): restart a daemon that exits unexpectedly, with backoff; 0: stop the node
#   ROLLOUTD_ROUTER_SHARDS  router.shards for every daemon (default: the config's, 1); with K > 1 the
#                         head node also runs router1 .. router{K-1} (`rolloutd router --shard i`)
set -uo pipefail

BIN=${ROLLOUTD_BIN:-rolloutd}
PORT=${ROLLOUTD_BASE_PORT:-5550}
SELF=$(readlink -f "${BASH_SOURCE[0]}")
STEP_NAME=rolloutd-nodes
IGNORE_OK=0
env --help 2>/dev/null | grep -q -- --ignore-signal && IGNORE_OK=1

HOST=${SLURMD_NODENAME:-${HOSTNAME%%.*}}
# JSON lines like the daemons' own logs. Builtins only (no $(...)): Slurm signals every process
# of the step, and a trap that fires while bash parses a command substitution breaks it.
log() {
    local ts
    TZ=UTC printf -v ts '%(%Y-%m-%dT%H:%M:%SZ)T' -1
    printf '{"event": "%s", "daemon": "slurm-launcher", "node": "%s", "job": "%s", "timestamp": "%s"%s}\n' \
        "$1" "${NODE:-$HOST}" "${SLURM_JOB_ID:-}" "$ts" "${2:+, $2}" >&2
}
die() { log launcher_error "\"error\": \"$*\""; exit 1; }

require_allocation() {
    [[ -n ${SLURM_JOB_ID:-} && -n ${SLURM_JOB_NODELIST:-} ]] || die "not inside a Slurm allocation (no SLURM_JOB_ID/SLURM_JOB_NODELIST)"
}

derive_head() {
    # The head is the first host of the allocation; its address comes from Slurm's node table.
    mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
    ((${#HOSTS[@]})) || die "scontrol show hostnames returned nothing for $SLURM_JOB_NODELIST"
    HEAD_NODE=${ROLLOUTD_HEAD_NODE:-${HOSTS[0]}}
    if [[ -z ${ROLLOUTD_HEAD_ADDR:-} ]]; then
        ROLLOUTD_HEAD_ADDR=$(scontrol show node -o "$HEAD_NODE" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeAddr=//p' | head -n1)
        [[ -n $ROLLOUTD_HEAD_ADDR ]] || ROLLOUTD_HEAD_ADDR=$HEAD_NODE
    fi
    export ROLLOUTD_HEAD_NODE=$HEAD_NODE ROLLOUTD_HEAD_ADDR
    GATEWAY="tcp://$ROLLOUTD_HEAD_ADDR:$PORT"
    EVENTS="tcp://$ROLLOUTD_HEAD_ADDR:$((PORT + 5))"
}

cmd_env() {
    require_allocation
    derive_head
    printf 'head_node=%s\nhead_addr=%s\nnodes=%s\ngateway=%s\nevents=%s\n' \
        "$HEAD_NODE" "$ROLLOUTD_HEAD_ADDR" "${HOSTS[*]}" "$GATEWAY" "$EVENTS"
}

cmd_launch() {
    require_allocation
    derive_head
    local n=${SLURM_JOB_NUM_NODES:-${#HOSTS[@]}}
    log launching "\"head\": \"$HEAD_NODE\", \"head_addr\": \"$ROLLOUTD_HEAD_ADDR\", \"nodes\": $n, \"gateway\": \"$GATEWAY\""
    srun --job-name="$STEP_NAME" --nodes="$n" --ntasks="$n" --ntasks-per-node=1 --kill-on-bad-exit=0 \
        --export=ALL bash "$SELF" node &
    STEP_PID=$!
    trap stop_step TERM INT HUP
    local rc=0
    while :; do
        wait "$STEP_PID"; rc=$?
        kill -0 "$STEP_PID" 2>/dev/null || break   # wait returned because of a trapped signal: keep waiting
    done
    log launch_finished "\"rc\": $rc"
    return "$rc"
}

# Ask every node to stop its daemons in pipeline order. Not by signalling srun (on SIGTERM it
# kills the step outright), and not with SIGTERM to the step (Slurm delivers it to every process
# of the step at once): SIGUSR1 to our step only; the daemons were started with SIGUSR1 ignored,
# so only each node's launcher acts on it.
stop_step() {
    local sid=""
    if ((IGNORE_OK)); then
        sid=$(squeue -h -s -j "$SLURM_JOB_ID" -o '%i %j' 2>/dev/null | while read -r id name; do
                  [[ $name == "$STEP_NAME" ]] && { echo "$id"; break; }; done)
    fi
    if [[ -n $sid ]] && scancel --signal=USR1 "$sid" 2>/dev/null; then
        log forwarding_stop "\"step\": \"$sid\", \"signal\": \"USR1\""
    else
        log forwarding_stop "\"signal\": \"TERM\", \"to\": \"srun\""
        kill -TERM "$STEP_PID" 2>/dev/null
    fi
}

# -- one node -------------------------------------------------------------------------------
declare -A PID=()       # daemon name -> pid
declare -A NAME_OF=()   # pid -> daemon name
declare -A BACKOFF=()
SHARDS_DOWN=()          # router shards 1.. in stop order (ROLLOUTD_ROUTER_SHARDS)
STOPPING=0

start_daemon() {
    local name=$1
    local pre=()
    # SIGUSR1 is the launcher's "stop in order" request (see stop_step); the daemons ignore it.
    ((IGNORE_OK)) && pre+=(env --ignore-signal=USR1)
    # PR_SET_PDEATHSIG where setpriv supports it: a daemon never outlives this script.
    ((PDEATHSIG)) && pre+=(setpriv --pdeathsig TERM --)
    local cmd=("$name")
    [[ $name =~ ^router[1-9][0-9]*$ ]] && cmd=(router --shard "${name#router}")   # a router shard
    "${pre[@]}" "$BIN" "${cmd[@]}" "${ARGS[@]}" </dev/null &
    PID[$name]=$!
    NAME_OF[$!]=$name
    log daemon_spawned "\"child\": \"$name\", \"pid\": $!"
}

stop_all() {
    STOPPING=1
    trap '' TERM INT HUP USR1   # already stopping; the running daemons keep their own handlers
    local drain=${DRAIN%.*}
    local deadline_s=$(( ${drain:-0} + 5 ))
    local name pid t rc
    for name in init run eval gateway "${SHARDS_DOWN[@]}" router events; do
        pid=${PID[$name]:-}
        [[ -n $pid ]] || continue
        kill -TERM "$pid" 2>/dev/null
        for ((t = 0; t < deadline_s * 10; t++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        if kill -0 "$pid" 2>/dev/null; then
            log daemon_killed "\"child\": \"$name\", \"reason\": \"did not stop within ${deadline_s}s\""
            kill -KILL "$pid" 2>/dev/null
        fi
        wait "$pid" 2>/dev/null
        rc=$?
        [[ -n ${NAME_OF[$pid]:-} ]] && log daemon_exited "\"child\": \"$name\", \"rc\": $rc"
    done
    rm -f "$RUNTIME"/*.sock
    rmdir "$RUNTIME/sandboxes" "$RUNTIME" 2>/dev/null
    [[ -n ${INFO:-} ]] && rm -f "$INFO"
    log node_stopped
}

cmd_node() {
    require_allocation
    derive_head
    NODE=$HOST
    RUNTIME=${ROLLOUTD_RUNTIME_DIR:-${TMPDIR:-/tmp}/rolloutd-$SLURM_JOB_ID}
    DRAIN=${ROLLOUTD_DRAIN_S:-10}
    PDEATHSIG=0
    setpriv --help 2>/dev/null | grep -q -- --pdeathsig && PDEATHSIG=1
    command -v "$BIN" >/dev/null || die "rolloutd executable '$BIN' not found (set ROLLOUTD_BIN)"
    mkdir -p "$RUNTIME" && chmod 700 "$RUNTIME" || die "cannot create runtime dir $RUNTIME"

    ARGS=()
    [[ -n ${ROLLOUTD_CONFIG:-} ]] && ARGS+=(--config "$ROLLOUTD_CONFIG")
    ARGS+=(--set "node=$NODE" --set "endpoints.head=$ROLLOUTD_HEAD_ADDR" --set "endpoints.base_port=$PORT"
           --set "endpoints.runtime_dir=$RUNTIME")
    [[ -n ${ROLLOUTD_KEYS_DIR:-} ]] && ARGS+=(--set "keys_dir=$ROLLOUTD_KEYS_DIR")
    [[ -n ${ROLLOUTD_DRAIN_S:-} ]] && ARGS+=(--set "daemon.drain_s=$ROLLOUTD_DRAIN_S")
    local s i
    for s in ${ROLLOUTD_SET:-}; do ARGS+=(--set "$s"); done
    # Router shards beyond the first run on the head beside the router, stopped before it.
    local shards=${ROLLOUTD_ROUTER_SHARDS:-1} routers=(router)
    [[ $shards =~ ^[1-9][0-9]*$ ]] || die "ROLLOUTD_ROUTER_SHARDS must be a whole number >= 1, not '$shards'"
    ((shards > 1)) && ARGS+=(--set "router.shards=$shards")
    SHARDS_DOWN=()
    for ((i = 1; i < shards; i++)); do routers+=("router$i"); SHARDS_DOWN=("router$i" "${SHARDS_DOWN[@]}"); done

    trap 'STOPPING=1' TERM INT HUP USR1
    local names=(eval run init)
    local is_head=0
    [[ $NODE == "$HEAD_NODE" || $NODE == "${HEAD_NODE%%.*}" ]] && is_head=1
    ((is_head)) && names=(events "${routers[@]}" gateway eval run init)
    log node_starting "\"head\": $is_head, \"runtime_dir\": \"$RUNTIME\", \"daemons\": \"${names[*]}\""
    local name
    for name in "${names[@]}"; do
        start_daemon "$name"
        BACKOFF[$name]=1
    done
    if ((is_head)); then
        INFO=${ROLLOUTD_INFO_FILE:-${SLURM_SUBMIT_DIR:-$PWD}/rolloutd-$SLURM_JOB_ID.json}
        printf '{"job_id": "%s", "head_node": "%s", "head_addr": "%s", "gateway": "%s", "events": "%s", "nodes": "%s", "keys_dir": "%s"}\n' \
            "$SLURM_JOB_ID" "$HEAD_NODE" "$ROLLOUTD_HEAD_ADDR" "$GATEWAY" "$EVENTS" "${HOSTS[*]}" "${ROLLOUTD_KEYS_DIR:-}" \
            > "$INFO.tmp" && mv -f "$INFO.tmp" "$INFO"
        log info_written "\"file\": \"$INFO\""
    fi

    # Supervise: poll once a second (a trap interrupts the sleep at once). Not `wait -n`: a child
    # that died before it was called is already reaped and would never be reported.
    local pid rc tick
    declare -A DUE=() STARTED=()
    for name in "${names[@]}"; do STARTED[$name]=$SECONDS; done
    while ((!STOPPING)); do
        sleep 1 & tick=$!
        wait "$tick" 2>/dev/null
        kill "$tick" 2>/dev/null
        ((STOPPING)) && break
        for name in "${names[@]}"; do
            if [[ -n ${DUE[$name]:-} ]]; then
                if ((SECONDS >= DUE[$name])); then
                    unset "DUE[$name]"
                    start_daemon "$name"
                    STARTED[$name]=$SECONDS
                    log daemon_restarted "\"child\": \"$name\""
                fi
                continue
            fi
            pid=${PID[$name]}
            kill -0 "$pid" 2>/dev/null && continue
            wait "$pid" 2>/dev/null
            rc=$?
            unset "NAME_OF[$pid]"
            log daemon_exited "\"child\": \"$name\", \"rc\": $rc"
            if [[ ${ROLLOUTD_RESTART:-1} != 1 ]]; then
                STOPPING=1
                break
            fi
            ((SECONDS - STARTED[$name] > 60)) && BACKOFF[$name]=1   # it ran a while: forgive
            DUE[$name]=$((SECONDS + BACKOFF[$name]))
            BACKOFF[$name]=$((BACKOFF[$name] * 2 > 30 ? 30 : BACKOFF[$name] * 2))
        done
    done
    stop_all
}

case ${1:-} in
    launch) cmd_launch ;;
    node) cmd_node ;;
    env) cmd_env ;;
    *) echo "usage: $0 launch|node|env   (see the header of $SELF)" >&2; exit 2 ;;
esac
