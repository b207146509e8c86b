#!/usr/bin/env bash
# `make bench`: measures ratekeeper on this machine and writes BENCHMARKS.md.
#
# Builds the release binaries, starts its own redis-server and ratekeeper
# processes (in-memory and Redis stores) on free loopback ports with the
# limits in bench/limits/, and runs every scenario BENCH_RUNS times, in
# rounds (each round runs every scenario once, so ratios are taken within a
# round), plus redis-benchmark running the limiter alone, as a script by
# EVALSHA and as a function by FCALL (as ratekeeper calls it on Redis 7), as
# the Redis ceiling, what a sliding-log request's hits cost Redis
# (bench/sliding_log_hits.sh), a resident-memory measurement and a sweep
# check; then bench/feature_costs.sh (tracing, value_to_metric, dynamic
# metadata: what each costs per request).
# Results (one JSON object per run) go to target/bench/results.jsonl; the
# report is made from them by bench/report.py.
#
# Settings (environment):
#   BENCH_SECONDS=5        measured seconds per run (plus BENCH_WARMUP=1)
#   BENCH_RUNS=3           rounds; the report gives medians
#   BENCH_CONCURRENCY=256  requests in flight (closed loop; most in flight, open loop)
#   BENCH_CONNECTIONS=4    HTTP/2 connections from the generator
#   BENCH_THREADS=2        generator threads
#   BENCH_REDIS_POOL=4     ratekeeper's --redis-pool-size
#   BENCH_MEMORY_KEYS=1000000   distinct keys for the resident-size check
#   BENCH_SWEEP_SECONDS=60 BENCH_SWEEP_RATE=20000   the sweep check
#   BENCH_PERF=auto        profile ratekeeper with perf (auto|0|1)
#   BENCH_OUT=BENCHMARKS.md
#   BENCH_SCENARIOS="redis budget_redis"   run only these scenarios (names
#                          as in the rounds below), and none of the h2load,
#                          redis-benchmark, sliding log, profile, memory and
#                          sweep parts; the report then goes to
#                          target/bench/BENCHMARKS.partial.md, and only its
#                          "Reserve and settle" section, if it has one, is
#                          put into BENCH_OUT (replacing the one there)
set -euo pipefail

cd "$(dirname "$0")/.."
ROOT=$PWD
SECS=${BENCH_SECONDS:-5}
WARMUP=${BENCH_WARMUP:-1}
RUNS=${BENCH_RUNS:-3}
CONC=${BENCH_CONCURRENCY:-256}
CONNS=${BENCH_CONNECTIONS:-4}
THREADS=${BENCH_THREADS:-2}
POOL=${BENCH_REDIS_POOL:-4}
MEMORY_KEYS=${BENCH_MEMORY_KEYS:-1000000}
SWEEP_SECONDS=${BENCH_SWEEP_SECONDS:-60}
SWEEP_RATE=${BENCH_SWEEP_RATE:-20000}
PERF=${BENCH_PERF:-auto}
OUT=${BENCH_OUT:-BENCHMARKS.md}
SCENARIOS=${BENCH_SCENARIOS:-}
LIMITS=$ROOT/bench/limits
RK=$ROOT/target/release/ratekeeper
GEN=$ROOT/target/release/ratekeeper-bench
RESULTS_DIR=$ROOT/target/bench
RESULTS=$RESULTS_DIR/results.jsonl

. bench/lib.sh # free_port, cpu_ticks, h2load_rls, write_limiter, LIMITER_CALL

log() { printf '[bench %s] %s\n' "$(date +%H:%M:%S)" "$*" >&2; }
die() { log "error: $*"; exit 1; }

# --- processes: every one we start is stopped by PID on exit -------------
PIDS=()
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ratekeeper-bench.XXXXXX")
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
    done
    for pid in "${PIDS[@]}"; do
        wait "$pid" 2>/dev/null || true
    done
    rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

forget() { # PID: a process of ours that has exited and been waited for
    local pid keep=()
    for pid in "${PIDS[@]}"; do
        [ "$pid" = "$1" ] || keep+=("$pid")
    done
    PIDS=("${keep[@]}")
}

stop() { # PID: stops one process we started
    kill "$1" 2>/dev/null || true
    wait "$1" 2>/dev/null || true
    forget "$1"
}

# --- tools ----------------------------------------------------------------
if ! command -v redis-server >/dev/null || ! command -v redis-benchmark >/dev/null; then
    log "installing redis-server and redis-tools"
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server redis-tools >/dev/null
fi
if ! command -v h2load >/dev/null && { [ -z "$SCENARIOS" ] || [[ $SCENARIOS == *h2load* ]]; }; then
    log "installing h2load (nghttp2-client)"
    SUDO=$([ "$(id -u)" = 0 ] || echo sudo)
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq nghttp2-client >/dev/null
fi
command -v python3 >/dev/null || die "python3 is needed to write the report"

# How busy the machine is with other work before we start (shared machine).
cpu_busy_percent() {
    local a b
    a=$(head -n 1 /proc/stat)
    sleep 2
    b=$(head -n 1 /proc/stat)
    awk -v a="$a" -v b="$b" 'BEGIN {
        split(a, x); split(b, y); total = 0; idle = 0
        for (i = 2; i <= 9; i++) total += y[i] - x[i]
        idle = (y[5] - x[5]) + (y[6] - x[6])
        busy = 0
        if (total > 0) busy = 100 * (total - idle) / total
        printf "%.0f", busy }'
}
BENCH_BACKGROUND_BUSY=$(cpu_busy_percent)
export BENCH_BACKGROUND_BUSY
log "machine busy with other work: ${BENCH_BACKGROUND_BUSY}% of $(nproc) cores"

log "building release binaries"
cargo build --release --quiet -p ratekeeper -p ratekeeper-bench --bins

rss_kib() { # PID -> resident set size in KiB
    awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"
}

# --- Redis -------------------------------------------------------------------
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --daemonize no --logfile "$WORK/redis.log" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
rcli() { redis-cli -h 127.0.0.1 -p "$REDIS_PORT" "$@"; }
for _ in $(seq 50); do
    rcli PING >/dev/null 2>&1 && break
    sleep 0.1
done
rcli PING >/dev/null || die "redis-server did not start (see its log)"
write_limiter "$WORK"
SHA=$(rcli -x SCRIPT LOAD <"$WORK/script.lua")
FUNCTION=$(head -n 1 "$WORK/library.lua" | sed 's/^#!lua name=//')
[ "$(rcli -x FUNCTION LOAD <"$WORK/library.lua")" = "$FUNCTION" ] || die "FUNCTION LOAD failed"
log "redis-server pid $REDIS_PID on 127.0.0.1:$REDIS_PORT, limiter script $SHA, function $FUNCTION"

# --- ratekeeper --------------------------------------------------------------
# start_ratekeeper NAME [flags...]: sets NAME_PID, NAME_ADDR and NAME_METRICS
# (metrics on, as in production; h2load runs read its decision counters;
# RK_METRICS=off turns them off).
start_ratekeeper() {
    local name=$1 addr="" pid
    shift
    "$RK" --config-dir "$LIMITS" --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --debug-addr 127.0.0.1:0 --metrics-addr "${RK_METRICS:-127.0.0.1:0}" \
        --log-level warn "$@" >"$WORK/$name.out" 2>"$WORK/$name.err" &
    pid=$!
    PIDS+=("$pid")
    for _ in $(seq 100); do
        addr=$(sed -n 's/^listening grpc=\([^ ]*\).*/\1/p' "$WORK/$name.out")
        [ -n "$addr" ] && break
        kill -0 "$pid" 2>/dev/null || { cat "$WORK/$name.err" >&2; die "ratekeeper ($name) exited"; }
        sleep 0.1
    done
    [ -n "$addr" ] || die "ratekeeper ($name) did not print its address"
    printf -v "${name}_PID" '%s' "$pid"
    printf -v "${name}_ADDR" '%s' "$addr"
    printf -v "${name}_METRICS" '%s' "$(sed -n 's/^listening .* metrics=\([^ ]*\).*/\1/p' "$WORK/$name.out")"
    [ -n "${QUIET_START:-}" ] || log "ratekeeper ($name) pid $pid on $addr"
}

start_ratekeeper mem
start_ratekeeper red --redis-url "redis://127.0.0.1:$REDIS_PORT" \
    --redis-pool-size "$POOL" --redis-timeout-ms 1000
mkdir -p "$RESULTS_DIR"
: >"$RESULTS"

# fresh_store STORE(mem|red): every run starts from an empty store — Redis
# is flushed, the in-memory ratekeeper restarted.
fresh_store() {
    if [ "$1" = red ]; then
        rcli FLUSHALL >/dev/null
        rcli CONFIG RESETSTAT >/dev/null
    else
        stop "$mem_PID"
        QUIET_START=1 start_ratekeeper mem
    fi
}

# script_calls: limiter calls (FCALL and EVALSHA) Redis ran since its stats
# were reset.
script_calls() {
    rcli INFO commandstats | tr -d '\r' |
        sed -n 's/^cmdstat_\(fcall\|evalsha\):calls=\([0-9]*\),.*/\2/p' |
        awk '{ n += $1 } END { print n + 0 }'
}

# selected NAME: whether BENCH_SCENARIOS (empty: all) names NAME.
selected() {
    [ -z "$SCENARIOS" ] || [[ " $SCENARIOS " == *" $1 "* ]]
}

# run_scenario ROUND NAME STORE(mem|red) GENERATOR-FLAGS...: one run, one
# JSON line in $RESULTS with the generator's line, the CPU the server and
# Redis used during it, and the script calls Redis ran.
run_scenario() {
    local round=$1 name=$2 store=$3
    shift 3
    selected "$name" || return 0
    fresh_store "$store"
    local pid_var="${store}_PID" addr_var="${store}_ADDR"
    local pid=${!pid_var} addr=${!addr_var}
    local rk0 rd0 rk1 rd1 line
    rk0=$(cpu_ticks "$pid")
    rd0=$(cpu_ticks "$REDIS_PID")
    line=$("$GEN" --addr "$addr" --duration "$SECS" --warmup "$WARMUP" \
        --concurrency "$CONC" --connections "$CONNS" --threads "$THREADS" \
        --label "$name" "$@" 2>>"$WORK/gen.err" | tail -n 1)
    rk1=$(cpu_ticks "$pid")
    rd1=$(cpu_ticks "$REDIS_PID")
    local calls=0
    [ "$store" = red ] && calls=$(script_calls)
    case $line in
        "{"*) ;;
        *) tail -n 5 "$WORK/gen.err" >&2; die "generator failed in $name" ;;
    esac
    printf '{"kind":"scenario","round":%s,"name":"%s","store":"%s","server_cpu_ticks":%s,"redis_cpu_ticks":%s,"script_calls":%s,"gen":%s}\n' \
        "$round" "$name" "$store" "$((rk1 - rk0))" "$((rd1 - rd0))" "$calls" "$line" >>"$RESULTS"
    python3 -c 'import json,sys; d=json.loads(sys.argv[1]); print("  %-16s %8.0f req/s  p50 %5d us  p99 %6d us  ok %d over %d err %d" % (sys.argv[2], d["rps"], d["p50_us"], d["p99_us"], d["ok"], d["over_limit"], d["errors"]))' "$line" "$name" >&2
}

# redis_ceiling ROUND COMMAND(EVALSHA|FCALL) PIPELINE REQUESTS: redis-benchmark,
# the limiter alone (fixed window, one key of 1M, as ratekeeper sends it).
redis_ceiling() {
    local round=$1 command=$2 pipeline=$3 n=$4 rps name
    name=$SHA
    [ "$command" = FCALL ] && name=$FUNCTION
    rcli FLUSHALL >/dev/null
    rps=$(redis-benchmark -h 127.0.0.1 -p "$REDIS_PORT" -c 50 -n "$n" -r 1000000 \
        -P "$pipeline" --csv "$command" "$name" "${LIMITER_CALL[@]}" | awk -F'"' 'NR == 2 { print $4 }')
    [ -n "$rps" ] || die "redis-benchmark gave no result"
    printf '{"kind":"redis-benchmark","round":%s,"command":"%s","pipeline":%s,"clients":50,"requests":%s,"rps":%s}\n' \
        "$round" "$command" "$pipeline" "$n" "$rps" >>"$RESULTS"
    log "  redis-benchmark $command -c 50 -P $pipeline: $rps req/s"
}

# The request h2load sends: one fixed request, gRPC-framed, as in the issue's
# reference measurements (`user_id` k0 has the high limit; `hot` is over).
"$GEN" --write-request "$WORK/fixed.bin" --domain bench_fw --keys uniform:1
"$GEN" --write-request "$WORK/hot.bin" --domain bench_fw --keys hot

# decisions STORE(mem|red): "OK OVER" answers ratekeeper has counted for
# bench_fw so far (its Prometheus hit counters; one hit per request here).
decisions() {
    local metrics_var="${1}_METRICS"
    python3 - "http://${!metrics_var}/metrics" <<'PY'
import sys, urllib.request
text = urllib.request.urlopen(sys.argv[1], timeout=5).read().decode()
def total(name):
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in text.splitlines()
               if line.startswith(name + "{") and 'domain="bench_fw"' in line)
over = total("ratekeeper_rate_limit_over_limit")
print(total("ratekeeper_rate_limit_total_hits") - over, over)
PY
}

# run_h2load ROUND NAME STORE(mem|red) BODY: h2load with the issue's settings
# (`-t1 -c16 -m32 -D<seconds>`) sending BODY; one JSON line in $RESULTS with
# h2load's counts, the answers ratekeeper counted meanwhile and the CPU used.
run_h2load() {
    local round=$1 name=$2 store=$3 body=$4
    selected "$name" || return 0
    fresh_store "$store"
    local pid_var="${store}_PID" addr_var="${store}_ADDR"
    local pid=${!pid_var} addr=${!addr_var}
    local before after rk0 rd0 rk1 rd1 out
    before=$(decisions "$store")
    rk0=$(cpu_ticks "$pid")
    rd0=$(cpu_ticks "$REDIS_PID")
    out=$(h2load_rls "$addr" "$body" "$SECS") || die "h2load failed in $name"
    rk1=$(cpu_ticks "$pid")
    rd1=$(cpu_ticks "$REDIS_PID")
    after=$(decisions "$store")
    local calls=0
    [ "$store" = red ] && calls=$(script_calls)
    python3 - "$out" "$round" "$name" "$store" "$before" "$after" "$((rk1 - rk0))" "$((rd1 - rd0))" \
        "$calls" >>"$RESULTS" <<'PY'
import json, sys
out, round_, name, store, before, after, rk, rd, calls = sys.argv[1:]
(ok0, over0), (ok1, over1) = (map(int, before.split())), (map(int, after.split()))
print(json.dumps({
    "kind": "h2load", "round": int(round_), "name": name, "store": store, **json.loads(out),
    "decided_ok": ok1 - ok0, "decided_over": over1 - over0,
    "server_cpu_ticks": int(rk), "redis_cpu_ticks": int(rd), "script_calls": int(calls),
}))
PY
    log "  $(tail -n 1 "$RESULTS" | python3 -c 'import json,sys; d=json.load(sys.stdin); print("%-18s %8.0f req/s  h2load done %d (failed %d)  ratekeeper answered OK %d, over %d" % (d["name"], d["rps"], d["done"], d["failed"] + d["errored"], d["decided_ok"], d["decided_over"]))')"
}

json_field() { # JSON FIELD
    python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"
}

rps_of() { # ROUND NAME -> that run's req/s
    python3 - "$RESULTS" "$1" "$2" <<'PY'
import json, sys
path, round_, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
for line in open(path):
    d = json.loads(line)
    if d.get("kind") == "scenario" and d["round"] == round_ and d["name"] == name:
        print(int(d["gen"]["rps"]))
PY
}

# --- throughput rounds -------------------------------------------------------
for round in $(seq "$RUNS"); do
    log "round $round of $RUNS (${SECS}s + ${WARMUP}s warm-up per run)"
    # Runs compared in a ratio follow each other (memory between memory_hot
    # and redis, then redis_hot; the 5-descriptor pair; h2load's memory and
    # Redis runs): the machine's other tenants change its speed from one
    # minute to the next.
    run_scenario "$round" memory_hot mem --domain bench_fw --keys hot
    run_scenario "$round" memory mem --domain bench_fw --keys distinct
    run_scenario "$round" redis red --domain bench_fw --keys distinct
    run_scenario "$round" redis_hot red --domain bench_fw --keys hot
    # Reserve and settle (issue #23): a Reserve of 100 then a Settle at 60 per
    # operation, on the keys of `redis` (compared with it, same round).
    run_scenario "$round" budget_redis red --domain bench_fw --keys distinct \
        --mode budget --estimate 100 --actual 60
    run_scenario "$round" redis_5desc red --domain bench_fw --keys distinct --descriptors 5
    run_scenario "$round" memory_5desc mem --domain bench_fw --keys distinct --descriptors 5
    for algorithm in sw sl tb lb; do
        run_scenario "$round" "redis_$algorithm" red --domain "bench_$algorithm" --keys distinct
    done
    # Open loop at an eighth, a quarter and half of this round's closed-loop
    # peak.
    peak=$(rps_of "$round" redis)
    run_scenario "$round" redis_open_eighth red --domain bench_fw --keys distinct --rate $((peak / 8))
    run_scenario "$round" redis_open_quarter red --domain bench_fw --keys distinct --rate $((peak / 4))
    run_scenario "$round" redis_open_half red --domain bench_fw --keys distinct --rate $((peak / 2))
    half=$(rps_of "$round" memory) # empty when `memory` is not selected
    half=$((${half:-0} / 2))
    run_scenario "$round" memory_open_half mem --domain bench_fw --keys distinct --rate "$half"
    # A rate far below any peak: what is left is the machine's wake-up latency.
    run_scenario "$round" memory_open_1k mem --domain bench_fw --keys distinct --rate 1000
    run_scenario "$round" redis_open_1k red --domain bench_fw --keys distinct --rate 1000
    # The issue's reference settings: h2load, one fixed request.
    run_h2load "$round" h2load_memory_over mem "$WORK/hot.bin"
    run_h2load "$round" h2load_memory mem "$WORK/fixed.bin"
    run_h2load "$round" h2load_redis red "$WORK/fixed.bin"
    run_h2load "$round" h2load_redis_over red "$WORK/hot.bin"
    # The two forms back to back at each pipeline depth, to be compared.
    [ -n "$SCENARIOS" ] && continue
    for command in EVALSHA FCALL; do redis_ceiling "$round" "$command" 1 $((SECS * 30000)); done
    for command in EVALSHA FCALL; do redis_ceiling "$round" "$command" 16 $((SECS * 100000)); done
done

# A selection of scenarios: its report, and its "Reserve and settle"
# section put into $OUT.
if [ -n "$SCENARIOS" ]; then
    export BENCH_SECONDS=$SECS BENCH_WARMUP=$WARMUP BENCH_RUNS=$RUNS BENCH_CONCURRENCY=$CONC \
        BENCH_CONNECTIONS=$CONNS BENCH_THREADS=$THREADS BENCH_REDIS_POOL=$POOL BENCH_SCENARIOS
    export BENCH_REDIS_VERSION="$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
    export BENCH_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
    python3 bench/report.py "$RESULTS" "$RESULTS_DIR" >"$RESULTS_DIR/BENCHMARKS.partial.md"
    log "wrote $RESULTS_DIR/BENCHMARKS.partial.md (raw results: $RESULTS)"
    python3 bench/report.py --splice budget "$RESULTS_DIR/BENCHMARKS.partial.md" "$OUT" &&
        log "put its \"Reserve and settle\" section into $OUT"
    exit 0
fi

# --- sliding log: what a request's hits cost Redis (issue 19) ----------------
log "sliding log: hits_addend 1 against 1,000,000 (bench/sliding_log_hits.sh)"
bench/sliding_log_hits.sh "$REDIS_PORT" "$FUNCTION" >>"$RESULTS" || die "bench/sliding_log_hits.sh failed"

# --- where the time goes -----------------------------------------------------
if [ "$PERF" = auto ]; then
    if command -v perf >/dev/null && perf record -q -o "$WORK/probe.data" -- true >/dev/null 2>&1; then
        PERF=1
    else
        PERF=0
        log "perf not available: no profile"
    fi
fi
if [ "$PERF" = 1 ]; then
    for store in mem red; do
        fresh_store "$store"
        pid_var="${store}_PID"
        addr_var="${store}_ADDR"
        "$GEN" --addr "${!addr_var}" --duration "$SECS" --warmup "$WARMUP" \
            --concurrency "$CONC" --connections "$CONNS" --threads "$THREADS" \
            --domain bench_fw --keys distinct >"$WORK/perf-gen.out" 2>&1 &
        gen_pid=$!
        PIDS+=("$gen_pid")
        sleep "$WARMUP"
        perf record -q -F 999 -g -p "${!pid_var}" -o "$WORK/perf-$store.data" \
            -- sleep "$SECS" >/dev/null 2>&1 || log "perf record failed ($store)"
        wait "$gen_pid" || true
        forget "$gen_pid"
        perf report -i "$WORK/perf-$store.data" --no-children --sort dso,symbol --stdio \
            -g none 2>/dev/null | grep '%' | sed 's/ *$//' >"$RESULTS_DIR/perf-$store.txt" || true
        log "profile of ratekeeper ($store): $RESULTS_DIR/perf-$store.txt"
    done
fi

# --- resident size with MEMORY_KEYS live counters ----------------------------
# Metrics off: the latency histogram holds up to 5 s of samples between
# upkeeps, which would be counted against the keys.
RK_METRICS=off start_ratekeeper rss
sleep 1
before=$(rss_kib "$rss_PID")
line=$("$GEN" --addr "$rss_ADDR" --requests "$MEMORY_KEYS" --duration 3600 --warmup 0 \
    --concurrency "$CONC" --connections "$CONNS" --threads "$THREADS" \
    --domain bench_mem --keys distinct --label memory_rss 2>>"$WORK/gen.err" | tail -n 1)
sleep 1
after=$(rss_kib "$rss_PID")
printf '{"kind":"rss","keys":%s,"before_kib":%s,"after_kib":%s,"gen":%s}\n' \
    "$MEMORY_KEYS" "$before" "$after" "$line" >>"$RESULTS"
log "resident size: $before KiB idle, $after KiB after $MEMORY_KEYS distinct keys"
stop "$rss_PID"

# --- expired counters are swept: RSS under a stream of distinct keys ---------
RK_METRICS=off start_ratekeeper sweep
sleep 1
base=$(rss_kib "$sweep_PID")
"$GEN" --addr "$sweep_ADDR" --rate "$SWEEP_RATE" --duration "$SWEEP_SECONDS" --warmup 0 \
    --concurrency "$CONC" --connections "$CONNS" --threads "$THREADS" \
    --domain bench_short --keys distinct --label sweep >"$WORK/sweep.out" 2>>"$WORK/gen.err" &
gen_pid=$!
PIDS+=("$gen_pid")
samples=""
for _ in $(seq "$SWEEP_SECONDS"); do
    sleep 1
    samples="$samples${samples:+,}$(rss_kib "$sweep_PID")"
done
wait "$gen_pid" || die "generator failed in the sweep check"
forget "$gen_pid"
line=$(tail -n 1 "$WORK/sweep.out")
printf '{"kind":"sweep","rate":%s,"seconds":%s,"base_kib":%s,"samples_kib":[%s],"gen":%s}\n' \
    "$SWEEP_RATE" "$SWEEP_SECONDS" "$base" "$samples" "$line" >>"$RESULTS"
log "sweep: RSS KiB per second: $samples"
stop "$sweep_PID"

# --- the report ----------------------------------------------------------------
export BENCH_SECONDS=$SECS BENCH_WARMUP=$WARMUP BENCH_RUNS=$RUNS BENCH_CONCURRENCY=$CONC \
    BENCH_CONNECTIONS=$CONNS BENCH_THREADS=$THREADS BENCH_REDIS_POOL=$POOL \
    BENCH_MEMORY_KEYS=$MEMORY_KEYS BENCH_SWEEP_SECONDS=$SWEEP_SECONDS BENCH_SWEEP_RATE=$SWEEP_RATE
export BENCH_H2LOAD_VERSION="$(h2load --version | sed -n 's/.*nghttp2\/\([^ ]*\).*/\1/p')"
export BENCH_REDIS_VERSION="$(redis-server --version | sed -n 's/.* v=\([^ ]*\).*/\1/p')"
export BENCH_COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo '+changes')"
python3 bench/report.py "$RESULTS" "$RESULTS_DIR" >"$WORK/report.md"
# The soak run's section (`make soak`, bench/soak.sh) is carried over.
if [ -f "$OUT" ] && grep -q '^<!-- soak:begin -->$' "$OUT"; then
    printf '\n' >>"$WORK/report.md"
    sed -n '/^<!-- soak:begin -->$/,/^<!-- soak:end -->$/p' "$OUT" >>"$WORK/report.md"
fi
mv "$WORK/report.md" "$OUT"
log "wrote $OUT (raw results: $RESULTS)"

# --- feature costs --------------------------------------------------------------
# Tracing, value_to_metric and dynamic metadata against the same servers
# without them, in rounds of their own; their section of $OUT is rewritten.
log "feature costs (bench/feature_costs.sh)"
FEATURES_OUT=$OUT bench/feature_costs.sh || die "bench/feature_costs.sh failed"
