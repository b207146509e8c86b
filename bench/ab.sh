#!/usr/bin/env bash
# A/B: two ratekeeper builds or settings measured in one run, alternating
# A, B, A, B... on one redis-server, so both see the same machine state (on
# a shared machine, runs minutes apart are not comparable).
#
#   bench/ab.sh [generator flags...]
#
# Settings (environment):
#   BIN_A, BIN_B    binaries (default target/release/ratekeeper for both)
#   ENV_A, ENV_B    environment for each, e.g. ENV_B=TOKIO_WORKER_THREADS=1
#   STORE=redis     redis or memory
#   TOOL=bench      bench (ratekeeper-bench with the flags given, default
#                   `--domain bench_fw --keys distinct`) or h2load (the
#                   issue's settings, one fixed request)
#   ROUNDS=3 SECS=5
# Prints one line per run: req/s, latency, CPU per request of ratekeeper,
# Redis and the generator (ratekeeper-bench only).
set -euo pipefail
cd "$(dirname "$0")/.."
BIN_A=${BIN_A:-target/release/ratekeeper}
BIN_B=${BIN_B:-target/release/ratekeeper}
STORE=${STORE:-redis} TOOL=${TOOL:-bench} ROUNDS=${ROUNDS:-3} SECS=${SECS:-5}
GEN=target/release/ratekeeper-bench
[ $# -gt 0 ] || set -- --domain bench_fw --keys distinct
[ -x "$GEN" ] || cargo build --release --quiet -p ratekeeper-bench
WORK=$(mktemp -d "${TMPDIR:-/tmp}/ratekeeper-ab.XXXXXX")
PIDS=()
trap 'kill "${PIDS[@]}" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT

. bench/lib.sh # free_port, cpu_ticks, h2load_rls
REDIS_PORT=$(free_port)
redis-server --port "$REDIS_PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$WORK/redis.log" &
REDIS_PID=$!
PIDS+=("$REDIS_PID")
until redis-cli -p "$REDIS_PORT" PING >/dev/null 2>&1; do sleep 0.1; done

declare -A PID ADDR
for v in A B; do
    bin_var=BIN_$v env_var=ENV_$v
    store_flags=()
    [ "$STORE" = redis ] && store_flags=(--redis-url "redis://127.0.0.1:$REDIS_PORT" --redis-pool-size 4)
    env ${!env_var:-} "${!bin_var}" --config-dir bench/limits --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --debug-addr 127.0.0.1:0 \
        --metrics-addr 127.0.0.1:0 --log-level warn "${store_flags[@]}" >"$WORK/$v.out" 2>&1 &
    PID[$v]=$!
    PIDS+=("$!")
    until ADDR[$v]=$(sed -n 's/^listening grpc=\([^ ]*\) .*/\1/p' "$WORK/$v.out") && [ -n "${ADDR[$v]}" ]; do
        kill -0 "${PID[$v]}" || { cat "$WORK/$v.out"; exit 1; }
        sleep 0.1
    done
done
"$GEN" --write-request "$WORK/fixed.bin" --domain bench_fw --keys uniform:1

run() { # A|B generator-flags...
    local v=$1 rk0 rd0 rk1 rd1 out
    shift
    redis-cli -p "$REDIS_PORT" FLUSHALL >/dev/null
    rk0=$(cpu_ticks "${PID[$v]}") rd0=$(cpu_ticks "$REDIS_PID")
    if [ "$TOOL" = h2load ]; then
        out=$(h2load_rls "${ADDR[$v]}" "$WORK/fixed.bin" "$SECS")
    else
        out=$("$GEN" --addr "${ADDR[$v]}" --duration "$SECS" --warmup 1 "$@" 2>/dev/null | tail -n 1)
    fi
    rk1=$(cpu_ticks "${PID[$v]}") rd1=$(cpu_ticks "$REDIS_PID")
    python3 - "$v" "$TOOL" "$out" $((rk1 - rk0)) $((rd1 - rd0)) "$(getconf CLK_TCK)" <<'PY'
import json, sys
v, tool, out, rk, rd, hz = sys.argv[1:]
d = json.loads(out)
if tool == "h2load":
    rps, n = d["rps"], d["succeeded"]
    latency, gen = f"mean {d['mean_us']:,.0f} µs", "–"
else:
    rps, n = d["rps"], d["calls"]
    latency = f"p50 {d['p50_us']} µs p99 {d['p99_us']} µs"
    gen = f"{d['client_cpu_us_per_req']:.1f}" if d.get("client_cpu_us_per_req") else "–"
us = lambda ticks: int(ticks) / int(hz) * 1e6 / max(n, 1)
print(f"{v}  {rps:9,.0f} req/s  {latency}  CPU µs/req: ratekeeper {us(rk):.1f}, Redis {us(rd):.1f}, generator {gen}")
PY
}
for _ in $(seq "$ROUNDS"); do
    run A "$@"
    run B "$@"
done
