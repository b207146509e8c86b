#!/usr/bin/env bash
# Instructions redis-server spends per call of the limiter script, counted by
# callgrind (repeatable, unlike timings on a shared machine): one fixed-window
# check per call, sent by redis-benchmark. Prints one line per script.
#
#   bench/lua_instructions.sh                 the joined script ratekeeper loads
#   bench/lua_instructions.sh FILE.lua ...    other scripts, same arguments
#
# Needs valgrind and redis-server; N (default 5000) calls are counted after
# 2000 uncounted warm-up calls.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-5000}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lua-instructions.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if [ $# -eq 0 ]; then
    cat lua/prelude.lua lua/fixed_window.lua lua/sliding_window.lua lua/sliding_log.lua \
        lua/gcra.lua lua/batch.lua >"$WORK/joined.lua"
    set -- "$WORK/joined.lua"
fi
KEY='rk:{bench_fw|user_id=key__rand_int__}:fw.3600'
ARGS=('' 1 1 fw 1000000000 3600000 0 1 1)
for script in "$@"; do
    port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.out" \
        redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
    pid=$!
    for _ in $(seq 150); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.2; done
    sha=$(redis-cli -p "$port" -x SCRIPT LOAD <"$script")
    redis-benchmark -p "$port" -c 10 -n 2000 -r 1000000 -q EVALSHA "$sha" 1 "$KEY" "${ARGS[@]}" >/dev/null
    callgrind_control -i on "$pid" >/dev/null
    redis-benchmark -p "$port" -c 10 -n "$N" -r 1000000 -q EVALSHA "$sha" 1 "$KEY" "${ARGS[@]}" >/dev/null
    callgrind_control -i off "$pid" >/dev/null
    redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
    wait "$pid" || true
    total=$(callgrind_annotate "$WORK/cg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }')
    echo "$(basename "$script"): $((total / N)) instructions per call (redis-server, incl. networking)"
    rm -f "$WORK/cg.out"
done
