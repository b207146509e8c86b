#!/usr/bin/env bash
# What optional features cost per request, each against the same server
# without it, in one run of rounds (every variant once per round, A and B
# back to back, so ratios are taken within a round on a shared machine):
#   tracing    TRACING_ENABLED=true at TRACING_SAMPLING_RATE=0.01, exporting
#              over OTLP/HTTP to a real receiver (bench/otlp_receiver.py),
#              against tracing off; memory and Redis, `--keys distinct` on
#              bench_fw (as `make bench`'s `memory` and `redis` scenarios);
#   metadata   domain bench_vtm (value_to_metric and metadata on its rule)
#              with RESPONSE_DYNAMIC_METADATA=true, and bench_vtm alone
#              (value_to_metric only: the server's metadata switch off),
#              against bench_fw with neither; `--keys uniform:1000` (values
#              within the metric series cap, as in steady use).
# Per run: throughput (closed loop), latency, and the CPU the ratekeeper
# process (and Redis) used per request, from /proc. Writes the "Feature
# costs" section of BENCHMARKS.md (between its markers; FEATURES_OUT=-
# prints it only); raw results in target/bench/features.jsonl.
#
#   bench/feature_costs.sh        (also run by `make bench`, after bench/run.sh's report)
#
# Settings: BENCH_RUNS=3 rounds (FEATURES_ROUNDS overrides), BENCH_SECONDS=5,
# BENCH_WARMUP=1, BENCH_CONCURRENCY=256, BENCH_CONNECTIONS=4,
# BENCH_THREADS=2, BENCH_REDIS_POOL=4 as in bench/run.sh; RATEKEEPER_BIN and
# RATEKEEPER_BENCH_BIN other builds (default target/release/).
set -euo pipefail
cd "$(dirname "$0")/.."
ROUNDS=${FEATURES_ROUNDS:-${BENCH_RUNS:-3}}
SECS=${BENCH_SECONDS:-5}
WARMUP=${BENCH_WARMUP:-1}
CONC=${BENCH_CONCURRENCY:-256}
CONNS=${BENCH_CONNECTIONS:-4}
THREADS=${BENCH_THREADS:-2}
POOL=${BENCH_REDIS_POOL:-4}
OUT=${FEATURES_OUT:-BENCHMARKS.md}
RK=${RATEKEEPER_BIN:-target/release/ratekeeper}
GEN=${RATEKEEPER_BENCH_BIN:-target/release/ratekeeper-bench}
RESULTS=target/bench/features.jsonl

. bench/lib.sh # free_port, cpu_ticks
log() { printf '[features %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

PIDS=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ratekeeper-features.XXXXXX")
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for pid in "${PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

[ -x "$RK" ] && [ -x "$GEN" ] || cargo build --release --quiet -p ratekeeper -p ratekeeper-bench --bins

REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$WORK/redis.log" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
for _ in $(seq 50); do redis-cli -p "$REDIS_PORT" PING >/dev/null 2>&1 && break; sleep 0.1; done

python3 bench/otlp_receiver.py >"$WORK/otlp.out" &
OTLP_PID=$!
PIDS+=("$OTLP_PID")
until OTLP_PORT=$(sed -n 's/^listening //p' "$WORK/otlp.out" 2>/dev/null) && [ -n "$OTLP_PORT" ]; do sleep 0.1; done

# The servers: NAME -> store (mem|red) and environment.
declare -A STORE ENVS PID ADDR
TRACING="TRACING_ENABLED=true TRACING_SAMPLING_RATE=0.01 OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:$OTLP_PORT"
STORE[mem_off]=mem ENVS[mem_off]=""
STORE[mem_trace]=mem ENVS[mem_trace]=$TRACING
STORE[mem_meta]=mem ENVS[mem_meta]="RESPONSE_DYNAMIC_METADATA=true"
STORE[red_off]=red ENVS[red_off]=""
STORE[red_trace]=red ENVS[red_trace]=$TRACING
STORE[red_meta]=red ENVS[red_meta]="RESPONSE_DYNAMIC_METADATA=true"

start() { # NAME: (re)starts that server, sets PID[NAME] and ADDR[NAME]
    local name=$1 flags=() addr=""
    [ "${STORE[$name]}" = red ] &&
        flags=(--redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-pool-size "$POOL" --redis-timeout-ms 1000)
    # shellcheck disable=SC2086 # ENVS holds VAR=value words
    env ${ENVS[$name]} "$RK" --config-dir bench/limits --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --debug-addr 127.0.0.1:0 \
        --metrics-addr 127.0.0.1:0 --log-level warn "${flags[@]}" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    PID[$name]=$!
    PIDS+=("$!")
    for _ in $(seq 100); do
        addr=$(sed -n 's/^listening grpc=\([^ ]*\).*/\1/p' "$WORK/$name.out" 2>/dev/null)
        [ -n "$addr" ] && break
        kill -0 "${PID[$name]}" 2>/dev/null || { cat "$WORK/$name.err" >&2; die "ratekeeper ($name) exited"; }
        sleep 0.1
    done
    [ -n "$addr" ] || die "ratekeeper ($name) did not print its address"
    ADDR[$name]=$addr
}

# fresh NAME: an empty store for the next run (Redis flushed; an in-memory
# server restarted, as bench/run.sh does).
fresh() {
    if [ "${STORE[$1]}" = red ]; then
        redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
    else
        kill "${PID[$1]}" && wait "${PID[$1]}" 2>/dev/null || true
        start "$1"
    fi
}

# run ROUND FEATURE VARIANT SERVER GENERATOR-FLAGS...: one JSON line in $RESULTS.
run() {
    local round=$1 feature=$2 variant=$3 name=$4 rk0 rd0 rk1 rd1 line
    shift 4
    fresh "$name"
    rk0=$(cpu_ticks "${PID[$name]}") rd0=$(cpu_ticks "$REDIS_PID")
    line=$("$GEN" --addr "${ADDR[$name]}" --duration "$SECS" --warmup "$WARMUP" \
        --concurrency "$CONC" --connections "$CONNS" --threads "$THREADS" "$@" 2>>"$WORK/gen.err" | tail -n 1)
    rk1=$(cpu_ticks "${PID[$name]}") rd1=$(cpu_ticks "$REDIS_PID")
    case $line in "{"*) ;; *) tail -n 5 "$WORK/gen.err" >&2; die "generator failed ($feature $variant)" ;; esac
    printf '{"round":%s,"feature":"%s","variant":"%s","store":"%s","server_cpu_ticks":%s,"redis_cpu_ticks":%s,"gen":%s}\n' \
        "$round" "$feature" "$variant" "${STORE[$name]}" "$((rk1 - rk0))" "$((rd1 - rd0))" "$line" >>"$RESULTS"
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("  %-28s %8.0f req/s  p50 %5d us  p99 %6d us  errors %d" % (sys.argv[2], d["rps"], d["p50_us"], d["p99_us"], d["errors"]))' \
        "$line" "$feature/$variant/${STORE[$name]}" >&2
}

for name in "${!STORE[@]}"; do start "$name"; done
mkdir -p target/bench
: >"$RESULTS"
busy_before=$(awk '{ print $1 }' /proc/loadavg)
log "$ROUNDS rounds of ${SECS} s runs; load average before: $busy_before"
DISTINCT=(--domain bench_fw --keys distinct)
for round in $(seq "$ROUNDS"); do
    log "round $round"
    for s in mem red; do
        run "$round" tracing off "${s}_off" "${DISTINCT[@]}"
        run "$round" tracing on "${s}_trace" "${DISTINCT[@]}"
        run "$round" metadata off "${s}_off" --domain bench_fw --keys uniform:1000
        run "$round" metadata vtm "${s}_off" --domain bench_vtm --keys uniform:1000
        run "$round" metadata vtm_meta "${s}_meta" --domain bench_vtm --keys uniform:1000
    done
done
# The receiver's counts: the spans really left the servers.
kill "$OTLP_PID"
wait "$OTLP_PID" 2>/dev/null || true
otlp=$(tail -n 1 "$WORK/otlp.out")
log "OTLP receiver: $otlp"

python3 bench/feature_costs_report.py "$RESULTS" "$otlp" "$(getconf CLK_TCK)" \
    "FEATURES_ROUNDS=$ROUNDS BENCH_SECONDS=$SECS BENCH_WARMUP=$WARMUP BENCH_CONCURRENCY=$CONC BENCH_CONNECTIONS=$CONNS BENCH_THREADS=$THREADS BENCH_REDIS_POOL=$POOL bench/feature_costs.sh" \
    "$busy_before at the start, $(awk '{ print $1 }' /proc/loadavg) at the end" "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" >"$WORK/section.md"
if [ "$OUT" = - ]; then
    cat "$WORK/section.md"
elif [ -f "$OUT" ] && grep -q '^<!-- features:begin -->$' "$OUT"; then
    python3 - "$OUT" "$WORK/section.md" <<'PY'
import re, sys
out, section = sys.argv[1], open(sys.argv[2]).read()
text = open(out).read()
text = re.sub(r"<!-- features:begin -->\n.*?<!-- features:end -->\n", lambda _: section, text, flags=re.S)
open(out, "w").write(text)
PY
else
    printf '\n' >>"$OUT"
    cat "$WORK/section.md" >>"$OUT"
fi
log "wrote the feature costs to $OUT"
