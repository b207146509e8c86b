#!/usr/bin/env bash
# Instructions ratekeeper spends per operation on the Redis store, counted by
# callgrind (repeatable, unlike timings on a shared machine): ratekeeper
# under valgrind with one serving thread, a real redis-server, and
# ratekeeper-bench sending N operations (default 5000) at concurrency 32 on
# distinct keys of bench/limits' `bench_fw`, counted after 2,000 uncounted.
# MODE `redis` is one ShouldRateLimit per operation, `budget` one Reserve of
# 100 and its Settle at 60. Prints one line per binary and mode.
#
#   bench/rk_instructions.sh [BINARY ...]     default: target/release/ratekeeper
#
# MODES (default "redis budget") picks the modes. Needs valgrind.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh # free_port
N=${N:-5000}
MODES=${MODES:-redis budget}
GEN=target/release/ratekeeper-bench
WORK=$(mktemp -d "${TMPDIR:-/tmp}/rk-instructions.XXXXXX")
pids=()
trap 'for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$WORK"' EXIT
[ $# -gt 0 ] || { cargo build --release --quiet -p ratekeeper -p ratekeeper-bench --bins; set -- target/release/ratekeeper; }
[ -x "$GEN" ] || cargo build --release --quiet -p ratekeeper-bench

for bin in "$@"; do
    for mode in $MODES; do
        port=$(free_port)
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
        redis=$!
        pids+=("$redis")
        for _ in $(seq 50); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.1; done
        valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.out" \
            "$bin" --config-dir bench/limits --grpc-addr 127.0.0.1:0 --http-addr 127.0.0.1:0 --debug-addr 127.0.0.1:0 --metrics-addr 127.0.0.1:0 \
            --log-level warn --redis-url "redis://127.0.0.1:$port" --redis-pool-size 4 \
            --redis-timeout-ms 5000 --serving-threads 1 >"$WORK/rk.out" 2>/dev/null &
        rk=$!
        pids+=("$rk")
        addr=
        for _ in $(seq 300); do
            addr=$(sed -n 's/^listening grpc=\([^ ]*\).*/\1/p' "$WORK/rk.out")
            [ -n "$addr" ] && break
            sleep 0.2
        done
        [ -n "$addr" ] || { echo "ratekeeper under valgrind did not start" >&2; exit 1; }
        load=(--addr "http://$addr" --domain bench_fw --keys distinct --concurrency 32 --warmup 0 --duration 600)
        [ "$mode" = budget ] && load+=(--mode budget --estimate 100 --actual 60)
        "$GEN" "${load[@]}" --requests 2000 >/dev/null
        callgrind_control -i on "$rk" >/dev/null 2>&1
        "$GEN" "${load[@]}" --requests "$N" >/dev/null
        callgrind_control -i off "$rk" >/dev/null 2>&1
        kill "$rk" "$redis"
        wait "$rk" "$redis" 2>/dev/null || true
        total=$(callgrind_annotate "$WORK/cg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }')
        printf '%s, %s: %d instructions per operation\n' "$bin" "$mode" $((total / N))
        rm -f "$WORK/cg.out"
    done
done
