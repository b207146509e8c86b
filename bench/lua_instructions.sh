#!/usr/bin/env bash
# Instructions redis-server spends per limiter script call, counted by
# callgrind (repeatable, unlike timings on a shared machine), with
# redis-benchmark as the client. One-check fixed-window requests, three
# shapes of call:
#   lone       one request per call (ratekeeper at low load)
#   distinct   23 requests per call, each on a new key (batched, as under
#              load in `make bench`'s `redis` scenario)
#   same key   23 requests per call on one key (batched, one hot counter)
# and, with SHAPES="sl_1 sl_1m", lone one-check sliding_log requests of
# hits_addend 1 and 1,000,000 over 1,000 keys (every call admitted: a limit
# of 4,000,000,000 per hour); with SHAPES="lease lease_holder", lone
# acquires of lua/leases.lua (a new lease on one of 1,000 sets, without and
# with a holder; run it as `bench/lua_instructions.sh lua/leases.lua`); with
# SHAPES=budget, calls of the library's budget function carrying 15
# reserves on new fixed-window keys and the settles of the call before's
# (bench/budget_calls.py; the first measured call settles nothing).
# Prints one line per script and shape.
# SHAPES (default "lone distinct same") picks the shapes.
#
#   bench/lua_instructions.sh                 the limiter as ratekeeper loads it:
#                                             the joined script (EVALSHA) and the
#                                             function library (FCALL)
#   bench/lua_instructions.sh FILE.lua ...    other scripts, same arguments (a
#                                             file starting `#!lua name=N` is a
#                                             library called by FCALL N)
#
# Needs valgrind and redis-server; N (default 2000) calls are counted after
# 500 uncounted warm-up calls.
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh # free_port, write_limiter
N=${N:-2000}
BATCH=23
BUDGET_PAIRS=15
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lua-instructions.XXXXXX")
pid=
trap '[ -z "$pid" ] || kill "$pid" 2>/dev/null; rm -rf "$WORK"' EXIT
if [ $# -eq 0 ]; then
    [ -n "${RATEKEEPER_BIN:-}" ] || cargo build --release --quiet --bin ratekeeper
    write_limiter "$WORK"
    set -- "$WORK/script.lua" "$WORK/library.lua"
fi

# call_args REQUESTS SAME_KEY: numkeys, keys and arguments of one EVALSHA
# (redis-benchmark puts a new random number in each __rand_int__).
call_args() {
    local requests=$1 same=$2 i keys=() args=('')
    for i in $(seq "$requests"); do
        if [ "$same" = 1 ]; then
            keys+=('rk:{bench_fw|user_id=hot}:fw.3600')
        else
            keys+=("rk:{bench_fw|user_id=key${i}-__rand_int__}:fw.3600")
        fi
        args+=('1 1' 'fw 1000000000 3600000 0 1 1 0')
    done
    CALL=("$requests" "${keys[@]}" "${args[@]}")
}

# sliding_log_args HITS: one sliding-log check on one of 1,000 keys.
sliding_log_args() {
    CALL=(1 'rk:{bench_sl|user_id=key__rand_int__}:slw.3600' '' '1 1' "sl 4000000000 3600000 0 $1 1 0")
}

# lease_args HOLDER: one acquire on one of 1,000 lease sets, a new member.
lease_args() {
    CALL=(1 'rk:{bench_lease|user_id=key__rand_int__}:conn' acquire '' 'm__rand_int__' 60000 1000000 "$@")
}

for script in "$@"; do
    for shape in ${SHAPES:-lone distinct same}; do
        range=100000000
        case $shape in
            lone) call_args 1 0; requests=1; label="lone request" ;;
            distinct) call_args $BATCH 0; requests=$BATCH; label="$BATCH requests, distinct keys" ;;
            same) call_args $BATCH 1; requests=$BATCH; label="$BATCH requests, one key" ;;
            sl_1) sliding_log_args 1; requests=1; range=1000; label="sliding_log, hits 1" ;;
            sl_1m) sliding_log_args 1000000; requests=1; range=1000; label="sliding_log, hits 1,000,000" ;;
            lease) lease_args; requests=1; range=1000; label="lease acquire, no holder" ;;
            lease_holder) lease_args 'pod-a/conn-7'; requests=1; range=1000; label="lease acquire, with a holder" ;;
            budget)
                # The library's budget function only (the script form is a
                # script of its own, not written by --write-limiter-script).
                head -n 1 "$script" | grep -q '^#!lua name=' || continue
                requests=$BUDGET_PAIRS; label="$BUDGET_PAIRS reserves + $BUDGET_PAIRS settles a call, a request = a reserve+settle pair" ;;
            *) echo "unknown shape $shape" >&2; exit 2 ;;
        esac
        port=$(free_port)
        valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$WORK/cg.out" \
            redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
        pid=$!
        for _ in $(seq 150); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.2; done
        if head -n 1 "$script" | grep -q '^#!lua name='; then
            invoke=(FCALL "$(redis-cli -p "$port" -x FUNCTION LOAD <"$script")")
        else
            invoke=(EVALSHA "$(redis-cli -p "$port" -x SCRIPT LOAD <"$script")")
        fi
        if [ "$shape" = budget ]; then
            calls=(python3 bench/budget_calls.py "$port" "${invoke[1]}_budget")
            "${calls[@]}" 100 "$BUDGET_PAIRS" 0
            callgrind_control -i on "$pid" >/dev/null
            "${calls[@]}" "$N" "$BUDGET_PAIRS" 100000000
        else
            redis-benchmark -p "$port" -c 10 -n 500 -r "$range" -q "${invoke[@]}" "${CALL[@]}" >/dev/null
            callgrind_control -i on "$pid" >/dev/null
            redis-benchmark -p "$port" -c 10 -n "$N" -r "$range" -q "${invoke[@]}" "${CALL[@]}" >/dev/null
        fi
        callgrind_control -i off "$pid" >/dev/null
        redis-cli -p "$port" SHUTDOWN NOSAVE >/dev/null 2>&1 || true
        wait "$pid" || true
        pid=
        total=$(callgrind_annotate "$WORK/cg.out" 2>/dev/null | awk '/PROGRAM TOTALS/ && !done { gsub(",", "", $1); print $1; done = 1 }')
        printf '%s (%s), %s: %d instructions per request (%d per call; redis-server, incl. networking)\n' \
            "$(basename "$script")" "${invoke[0]}" "$label" $((total / N / requests)) $((total / N))
        rm -f "$WORK/cg.out"
    done
done
