#!/usr/bin/env bash
# The limiter's two forms timed against each other on one redis-server:
# redis-benchmark calls it as a script (EVALSHA) and as a function (FCALL),
# alternating, PAIRS times, so both see the same machine state (on a shared
# machine, runs minutes apart are not comparable; callgrind's instruction
# counts, bench/lua_instructions.sh, are the repeatable measure).
#
#   bench/limiter_forms.sh
#
# Settings (environment): PAIRS=10 CALLS=60000 (per run) PIPELINE=1.
# One fixed-window check per call on one of 1M keys, as `make bench`'s
# ceiling. Prints each run, then medians and the pairwise FCALL/EVALSHA
# ratios of req/s and of Redis CPU per call.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh # free_port, cpu_ticks, write_limiter, LIMITER_CALL
PAIRS=${PAIRS:-10} CALLS=${CALLS:-60000} PIPELINE=${PIPELINE:-1}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/limiter-forms.XXXXXX")
PORT=$(free_port)
redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no \
    --logfile "$WORK/redis.log" &
REDIS_PID=$!
trap 'kill "$REDIS_PID" 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$WORK"' EXIT
until redis-cli -p "$PORT" PING >/dev/null 2>&1; do sleep 0.1; done

cargo build --release --quiet --bin ratekeeper
write_limiter "$WORK"
declare -A NAME
NAME[EVALSHA]=$(redis-cli -p "$PORT" -x SCRIPT LOAD <"$WORK/script.lua")
NAME[FCALL]=$(redis-cli -p "$PORT" -x FUNCTION LOAD <"$WORK/library.lua")

for _ in $(seq "$PAIRS"); do
    for command in EVALSHA FCALL; do
        redis-cli -p "$PORT" FLUSHALL >/dev/null
        t0=$(cpu_ticks "$REDIS_PID")
        rps=$(redis-benchmark -p "$PORT" -c 50 -n "$CALLS" -r 1000000 -P "$PIPELINE" --csv \
            "$command" "${NAME[$command]}" "${LIMITER_CALL[@]}" | awk -F'"' 'NR == 2 { print $4 }')
        t1=$(cpu_ticks "$REDIS_PID")
        echo "$command $rps $((t1 - t0))"
    done
done | tee "$WORK/runs.txt"

python3 - "$WORK/runs.txt" "$CALLS" "$(getconf CLK_TCK)" <<'PY'
import statistics, sys
path, calls, hz = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
runs = {"EVALSHA": [], "FCALL": []}
for line in open(path):
    command, rps, ticks = line.split()
    runs[command].append((float(rps), int(ticks) / hz * 1e6 / calls))
for command, rows in runs.items():
    print(f"{command:8} median {statistics.median(r[0] for r in rows):9,.0f} req/s, "
          f"Redis CPU {statistics.median(r[1] for r in rows):.1f} µs/call")
pairs = list(zip(runs["EVALSHA"], runs["FCALL"]))
rps = [f[0] / e[0] for e, f in pairs]
cpu = [f[1] / e[1] for e, f in pairs]
print("FCALL / EVALSHA, pairwise: req/s median %.2f (%s); Redis CPU per call median %.2f (%s)" % (
    statistics.median(rps), ", ".join(f"{x:.2f}" for x in rps),
    statistics.median(cpu), ", ".join(f"{x:.2f}" for x in cpu)))
PY
