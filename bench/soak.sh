#!/usr/bin/env bash
# `make soak`: a long run of mixed load on two ratekeeper replicas sharing
# one Redis, while that Redis is killed and restarted and then failed over
# behind one address; writes a "Soak run" section into BENCHMARKS.md.
#
# Starts its own processes on free loopback ports (all stopped by PID on
# exit): redis-server A (primary) and B (replica of A), bench/forwarder.py in
# front of them (the one address ratekeeper knows: `--redis-type single`),
# two release ratekeeper replicas, and ratekeeper-soak (bench/src/soak/) for
# SOAK_SECONDS. Meanwhile, on a 1 s tick:
#   - every SOAK_RELOAD_SECONDS the limits of domain `soak` are rewritten
#     (its hot limit alternates), so both replicas reload under load;
#   - every SOAK_SAMPLE_SECONDS each replica's VmRSS is sampled;
#   - at 50% of the run A is SIGKILLed and restarted empty (no persistence;
#     B resyncs from it, empty too);
#   - at 70%, a failover behind the address: B REPLICAOF NO ONE, A REPLICAOF
#     B, the forwarder sends new connections to B (open ones stay on A).
# Every step's time goes to events.tsv; bench/soak_report.py holds the
# generator's per-second counts and audit admissions against them.
#
# Settings (environment):
#   SOAK_SECONDS=600           length of the load
#   SOAK_DISTINCT_RATE=200 SOAK_HOT_RATE=100 SOAK_AUDIT_RATE=20   calls/s
#   SOAK_AUDIT_LIMIT=10        audit values' limit per minute (4 values)
#   SOAK_LEASE_CLIENTS=8       lease clients (4 users, 2 leases each at most)
#   SOAK_DEADLINE_MS=100       an answer later than this is late
#   SOAK_REDIS_TIMEOUT_MS=20   ratekeeper's --redis-timeout-ms (its default)
#   SOAK_RELOAD_SECONDS=10 SOAK_SAMPLE_SECONDS=5
#   SOAK_OUT=BENCHMARKS.md     where the section goes ("-": stdout only)
#   SOAK_KEEP=0                1: keep the work directory (logs, raw data)
set -euo pipefail

cd "$(dirname "$0")/.."
SECS=${SOAK_SECONDS:-600}
DISTINCT_RATE=${SOAK_DISTINCT_RATE:-200}
HOT_RATE=${SOAK_HOT_RATE:-100}
AUDIT_RATE=${SOAK_AUDIT_RATE:-20}
AUDIT_LIMIT=${SOAK_AUDIT_LIMIT:-10}
LEASE_CLIENTS=${SOAK_LEASE_CLIENTS:-8}
DEADLINE_MS=${SOAK_DEADLINE_MS:-100}
REDIS_TIMEOUT_MS=${SOAK_REDIS_TIMEOUT_MS:-20}
RELOAD_EVERY=${SOAK_RELOAD_SECONDS:-10}
SAMPLE_EVERY=${SOAK_SAMPLE_SECONDS:-5}
OUT=${SOAK_OUT:-BENCHMARKS.md}
KILL_AT=$((SECS * 50 / 100))
FAILOVER_AT=$((SECS * 70 / 100))
RK=$PWD/target/release/ratekeeper
GEN=$PWD/target/release/ratekeeper-soak

. bench/lib.sh # free_port

log() { printf '[soak %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

PIDS=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ratekeeper-soak.XXXXXX")
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    if [ "${SOAK_KEEP:-0}" = 1 ]; then log "work directory kept: $WORK"; else rm -rf "$WORK"; fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

forget() { # PID: a process of ours that has exited and been waited for
    local pid keep=()
    for pid in "${PIDS[@]}"; do [ "$pid" = "$1" ] || keep+=("$pid"); done
    PIDS=("${keep[@]}")
}

now_ms() { date +%s%3N; }
event() { printf '%s\t%s\t%s\n' "$1" "$(now_ms)" "${2:-}" >>"$WORK/events.tsv"; }

command -v redis-server >/dev/null || die "redis-server is needed (make redis-server)"
command -v python3 >/dev/null || die "python3 is needed (the forwarder and the report)"
log "building release binaries"
cargo build --release --quiet -p ratekeeper -p ratekeeper-bench --bins

# --- Redis A (primary), B (its replica), the forwarder ------------------------
PORT_A=$(free_port)
PORT_B=$(free_port)
PORT_FWD=$(free_port)
PORT_CTL=$(free_port)
rcli() { local port=$1; shift; redis-cli -h 127.0.0.1 -p "$port" "$@"; }

start_redis() { # NAME PORT [redis-server flags]: sets NAME_PID
    local name=$1 port=$2
    shift 2
    # --dir: a replica's full sync writes an RDB file even with --save ''.
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no \
        --daemonize no --dir "$WORK" --dbfilename "redis-$name.rdb" \
        --logfile "$WORK/redis-$name.log" "$@" &
    PIDS+=("$!")
    printf -v "${name}_PID" '%s' "$!"
    for _ in $(seq 100); do
        rcli "$port" PING >/dev/null 2>&1 && return 0
        sleep 0.05
    done
    die "redis-server $name did not start (see $WORK/redis-$name.log)"
}

start_redis A "$PORT_A"
start_redis B "$PORT_B" --replicaof 127.0.0.1 "$PORT_A"
python3 bench/forwarder.py "$PORT_FWD" "$PORT_CTL" "$PORT_A" >"$WORK/forwarder.out" 2>"$WORK/forwarder.err" &
PIDS+=("$!")
for _ in $(seq 100); do
    grep -q ready "$WORK/forwarder.out" 2>/dev/null && break
    sleep 0.05
done
grep -q ready "$WORK/forwarder.out" || die "the forwarder did not start"
forward_to() { # PORT: new connections through the forwarder go there
    local reply
    exec 3<>"/dev/tcp/127.0.0.1/$PORT_CTL"
    printf 'target %s\n' "$1" >&3
    read -r reply <&3
    exec 3<&-
    [ "$reply" = ok ] || die "forwarder: $reply"
}
log "redis A :$PORT_A (primary), B :$PORT_B (replica), forwarder :$PORT_FWD -> A"

# --- limits -----------------------------------------------------------------
LIMITS=$WORK/limits
mkdir -p "$LIMITS"
cat >"$LIMITS/soak_audit.yaml" <<EOF
# Audit values: the admitted answers across both replicas are counted per
# value and window (bench/soak_report.py).
domain: soak_audit
descriptors:
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: $AUDIT_LIMIT}
EOF
cat >"$LIMITS/soak_lease.yaml" <<'EOF'
domain: soak_lease
concurrency:
  - key: user_id
    max_connections: 2
    lease_ttl: 3s
EOF
RELOADS=0
write_soak_limits() { # a new generation of domain soak, swapped in whole
    RELOADS=$((RELOADS + 1))
    cat >"$LIMITS/.soak.yaml.new" <<EOF
# generation $RELOADS
domain: soak
descriptors:
  - key: user_id
    value: hot
    rate_limit: {unit: second, requests_per_unit: $((40 + 10 * (RELOADS % 2)))}
  - key: user_id
    rate_limit: {unit: minute, requests_per_unit: 1000}
EOF
    mv "$LIMITS/.soak.yaml.new" "$LIMITS/soak.yaml"
}
write_soak_limits

# --- two ratekeeper replicas --------------------------------------------------
start_replica() { # N: sets RK<N>_PID and RK<N>_ADDR
    local n=$1 addr="" pid
    "$RK" --config-dir "$LIMITS" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --debug-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \
        --redis-url "redis://127.0.0.1:$PORT_FWD" --redis-type single \
        --redis-timeout-ms "$REDIS_TIMEOUT_MS" --log-level info \
        >"$WORK/rk$n.out" 2>"$WORK/rk$n.err" &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 100); do
        addr=$(sed -n 's/^listening grpc=\([^ ]*\).*/\1/p' "$WORK/rk$n.out")
        [ -n "$addr" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$WORK/rk$n.err" >&2; die "ratekeeper $n exited"; }
        sleep 0.1
    done
    [ -n "$addr" ] || die "ratekeeper $n did not print its address"
    printf -v "RK${n}_PID" '%s' "$pid"
    printf -v "RK${n}_ADDR" '%s' "$addr"
    sed -n 's/^listening .* metrics=\([^ ]*\).*/\1/p' "$WORK/rk$n.out" >"$WORK/rk$n.metrics-addr"
    log "ratekeeper $n pid $pid on $addr"
}
start_replica 0
start_replica 1

sample_rss() { # one line per replica: unix ms, replica, VmRSS KiB
    local n pid
    for n in 0 1; do
        pid_var="RK${n}_PID"
        pid=${!pid_var}
        [ -r "/proc/$pid/status" ] || continue
        printf '%s\t%s\t%s\n' "$(now_ms)" "$n" \
            "$(awk '/^VmRSS:/ { print $2 }' "/proc/$pid/status")" >>"$WORK/rss.tsv"
    done
}

# --- what the harness does to Redis ---------------------------------------------
kill_and_restart_a() {
    kill -KILL "$A_PID"
    wait "$A_PID" 2>/dev/null || true
    forget "$A_PID"
    event kill
    start_redis A "$PORT_A"
    event restart
    log "redis A killed and restarted empty"
}

fail_over_to_b() {
    local acked
    # Fence: once B has acknowledged everything written to A until now, only
    # what A admits from here to its demotion can be lost by the failover.
    event fence
    acked=$(printf 'SET soak:fence 1\nWAIT 1 2000\n' | rcli "$PORT_A" | tail -n 1)
    rcli "$PORT_B" REPLICAOF NO ONE >/dev/null
    event promote "$acked"
    rcli "$PORT_A" REPLICAOF 127.0.0.1 "$PORT_B" >/dev/null
    event demote
    forward_to "$PORT_B"
    event switch
    log "failed over to B behind the forwarder (replicas that acknowledged the fence: $acked)"
}

# --- the run --------------------------------------------------------------------
log "load for ${SECS}s: kill+restart at ${KILL_AT}s, failover at ${FAILOVER_AT}s"
GEN_ARGS=(--addr "$RK0_ADDR" --addr "$RK1_ADDR" --duration "$SECS"
    --distinct-rate "$DISTINCT_RATE" --hot-rate "$HOT_RATE" --audit-rate "$AUDIT_RATE"
    --lease-clients "$LEASE_CLIENTS" --deadline-ms "$DEADLINE_MS"
    --timeline-out "$WORK/timeline.jsonl" --audit-out "$WORK/audit.jsonl")
sample_rss
event start
"$GEN" "${GEN_ARGS[@]}" >"$WORK/gen.out" 2>"$WORK/gen.err" &
GEN_PID=$!
PIDS+=("$GEN_PID")
START_MS=$(now_ms)
next_sample=$SAMPLE_EVERY
next_reload=$RELOAD_EVERY
killed=0
failed_over=0
while kill -0 "$GEN_PID" 2>/dev/null; do
    elapsed=$((($(now_ms) - START_MS) / 1000))
    if [ "$elapsed" -ge "$next_sample" ]; then
        sample_rss
        next_sample=$((next_sample + SAMPLE_EVERY))
    fi
    if [ "$elapsed" -ge "$next_reload" ] && [ "$elapsed" -lt "$SECS" ]; then
        write_soak_limits
        event reload "$RELOADS"
        next_reload=$((next_reload + RELOAD_EVERY))
    fi
    if [ "$killed" = 0 ] && [ "$elapsed" -ge "$KILL_AT" ]; then
        kill_and_restart_a
        killed=1
    fi
    if [ "$failed_over" = 0 ] && [ "$elapsed" -ge "$FAILOVER_AT" ]; then
        fail_over_to_b
        failed_over=1
    fi
    sleep 0.2
done
GEN_STATUS=0
wait "$GEN_PID" || GEN_STATUS=$?
forget "$GEN_PID"
event end
sample_rss
[ "$GEN_STATUS" = 0 ] || { cat "$WORK/gen.err" >&2; die "ratekeeper-soak failed ($GEN_STATUS)"; }

# --- after the run: the store's audit counters, each replica's state ------------
for key in $(rcli "$PORT_B" --scan --pattern '*soak_audit*'); do
    printf '%s\t%s\n' "$key" "$(rcli "$PORT_B" HGETALL "$key" | paste -sd ' ')"
done >"$WORK/store_audit.tsv"
for n in 0 1; do
    pid_var="RK${n}_PID"
    alive=0
    kill -0 "${!pid_var}" 2>/dev/null && alive=1
    python3 -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
        "http://$(cat "$WORK/rk$n.metrics-addr")/metrics" >"$WORK/rk$n.metrics" 2>/dev/null || true
    printf '%s\t%s\t%s\n' "$n" "$alive" "$(grep -c 'panicked at' "$WORK/rk$n.err" || true)" >>"$WORK/replicas.tsv"
done

COMMAND="SOAK_SECONDS=$SECS make soak"
python3 bench/soak_report.py "$WORK" "$OUT" "$COMMAND" "$SECS" "$AUDIT_LIMIT" "$DEADLINE_MS"
