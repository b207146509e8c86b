#!/usr/bin/env bash
# What a sliding-log request costs Redis as its hits grow: the limiter
# function called by redis-benchmark on one-check sliding_log requests of
# hits_addend 1 and 1,000,000 (a limit of 4,000,000,000 per hour, so every
# call is admitted and stored), over 1,000 keys. Per hits value, one JSON
# line on stdout: Redis time per call (INFO commandstats), the slowest call
# (LATENCY HISTOGRAM's bucket: Redis runs one command at a time, so no
# other client waits longer for a call to end), the round trip of a PING
# sent meanwhile by another client (its slowest and 99th percentile), and
# the memory and sorted-set members per key.
#
#   bench/sliding_log_hits.sh                   own redis-server, the limiter
#                                               from the ratekeeper binary
#   bench/sliding_log_hits.sh PORT FUNCTION     a running Redis on 127.0.0.1:PORT
#                                               with the limiter library loaded
#                                               (bench/run.sh's)
#
# Settings: SL_HITS="1 1000000" the hits values, SL_CALLS=50000 calls per
# hits value, SL_CLIENTS=4 redis-benchmark clients, SL_KEYS=1000,
# SL_LIBRARY=FILE another limiter library to load (own redis-server only;
# e.g. an older version, to compare). Redis's latency histograms stop at
# about a second: a slowest call of 1073741 us means "a second or more".
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/lib.sh # free_port, write_limiter
HITS=${SL_HITS:-1 1000000}
CALLS=${SL_CALLS:-50000}
CLIENTS=${SL_CLIENTS:-4}
KEYS=${SL_KEYS:-1000}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/sliding-log-hits.XXXXXX")
redis_pid=
pinger_pid=
cleanup() {
    [ -z "$pinger_pid" ] || kill "$pinger_pid" 2>/dev/null || true
    [ -z "$redis_pid" ] || kill "$redis_pid" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

if [ $# -ge 2 ]; then
    port=$1
    function=$2
else
    port=$(free_port)
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null 2>&1 &
    redis_pid=$!
    for _ in $(seq 50); do redis-cli -p "$port" PING >/dev/null 2>&1 && break; sleep 0.1; done
    library=${SL_LIBRARY:-}
    if [ -z "$library" ]; then
        write_limiter "$WORK"
        library=$WORK/library.lua
    fi
    function=$(redis-cli -p "$port" -x FUNCTION LOAD <"$library")
fi
rcli() { redis-cli -h 127.0.0.1 -p "$port" "$@"; }
info_field() { # SECTION FIELD
    rcli INFO "$1" | tr -d '\r' | sed -n "s/^$2:\([0-9.]*\).*/\1/p"
}

# pinger SECONDS-FILE: PINGs Redis back to back on its own connection until
# killed, then writes "<max us> <p99 us> <pings>" to the file.
pinger() {
    exec python3 - "$port" "$1" <<'PY'
import signal, socket, sys, time
port, out = int(sys.argv[1]), sys.argv[2]
s = socket.create_connection(("127.0.0.1", port))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
samples = []
def done(*_):
    samples.sort()
    p99 = samples[int(len(samples) * 0.99)] if samples else 0
    with open(out, "w") as f:
        f.write(f"{samples[-1] if samples else 0} {p99} {len(samples)}\n")
    sys.exit(0)
signal.signal(signal.SIGTERM, done)
while True:
    t = time.perf_counter_ns()
    s.sendall(b"PING\r\n")
    reply = b""
    while not reply.endswith(b"\r\n"):
        reply += s.recv(64)
    samples.append((time.perf_counter_ns() - t) // 1000)
PY
}

for hits in $HITS; do
    rcli FLUSHALL >/dev/null
    rcli CONFIG RESETSTAT >/dev/null
    before=$(info_field memory used_memory)
    pinger "$WORK/ping" &
    pinger_pid=$!
    sleep 0.5
    start=$(date +%s.%N)
    redis-benchmark -h 127.0.0.1 -p "$port" -c "$CLIENTS" -n "$CALLS" -r "$KEYS" -q \
        FCALL "$function" 1 'rk:{bench_sl|user_id=key__rand_int__}:slw.3600' '' '1 1' \
        "sl 4000000000 3600000 0 $hits 1 0" >/dev/null
    end=$(date +%s.%N)
    kill "$pinger_pid"
    wait "$pinger_pid" || true
    pinger_pid=
    after=$(info_field memory used_memory)
    keys=$(rcli DBSIZE)
    members=$(rcli --scan --pattern 'rk:*' | sed 's/^/ZCARD /' | rcli | awk '{ n += $1 } END { print n + 0 }')
    stats=$(rcli INFO commandstats | tr -d '\r' | grep '^cmdstat_fcall:')
    # LATENCY HISTOGRAM: (bucket upper bound in us, calls so far) pairs,
    # fastest first, after "histogram_usec".
    histogram=$(rcli LATENCY HISTOGRAM fcall | awk 'on { printf "%s ", $1 } /histogram_usec/ { on = 1 }')
    read -r ping_max ping_p99 pings <"$WORK/ping"
    python3 - "$hits" "$CALLS" "$keys" "$members" "$before" "$after" "$stats" "$histogram" \
        "$ping_max" "$ping_p99" "$pings" "$start" "$end" <<'PY'
import json, re, sys
(hits, calls, keys, members, before, after, stats, histogram,
 ping_max, ping_p99, pings, start, end) = sys.argv[1:]
m = re.search(r"calls=(\d+),usec=(\d+),usec_per_call=([\d.]+)", stats)
pairs = [int(v) for v in histogram.split()]
buckets = list(zip(pairs[0::2], pairs[1::2]))
p99 = next(b for b, n in buckets if n >= 0.99 * buckets[-1][1])
print(json.dumps({
    "kind": "sliding_log_hits", "hits": int(hits), "calls": int(m.group(1)),
    "usec_per_call": float(m.group(3)), "call_p99_us_at_most": p99,
    "slowest_call_us_at_most": buckets[-1][0],
    "ping_max_us": int(ping_max), "ping_p99_us": int(ping_p99), "pings": int(pings),
    "keys": int(keys), "members_per_key": int(members) / max(int(keys), 1),
    "bytes_per_key": (int(after) - int(before)) / max(int(keys), 1),
    "seconds": float(end) - float(start),
}))
PY
done
