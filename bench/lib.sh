# Shell helpers shared by bench/run.sh, bench/ab.sh, bench/lua_instructions.sh
# and bench/limiter_forms.sh (sourced, not run).

free_port() { # a loopback TCP port nobody listens on right now
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

cpu_ticks() { # PID -> user + system clock ticks so far
    awk '{ print $14 + $15 }' "/proc/$1/stat"
}

# h2load_rls ADDR BODY SECONDS: h2load with the issue's reference settings
# (-t1 -c16 -m32) sending BODY, a gRPC-framed ShouldRateLimit request, to
# ratekeeper at ADDR; prints h2load's summary as one JSON object (seconds,
# rps, done, succeeded, failed, errored, timeout, mean_us). Fails, with
# h2load's last lines on stderr, when h2load does.
h2load_rls() {
    local out
    out=$(h2load -t1 -c16 -m32 -D"$3" -d "$2" -H 'content-type: application/grpc' \
        -H 'te: trailers' "http://$1/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit" 2>&1) ||
        { echo "$out" | tail -n 5 >&2; return 1; }
    python3 - "$out" <<'PY'
import json, re, sys
out = sys.argv[1]
finished = re.search(r"^finished in ([\d.]+)s, ([\d.]+) req/s", out, re.M)
counts = re.search(r"^requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, "
                   r"(\d+) failed, (\d+) errored, (\d+) timeout", out, re.M)
mean = re.search(r"^time for request:\s+\S+\s+\S+\s+(\S+)", out, re.M)
if not finished or not counts:
    sys.exit("h2load printed no summary:\n" + out)
def us(text):
    value, unit = re.match(r"([\d.]+)(\w+)", text).groups()
    return float(value) * {"us": 1, "ms": 1e3, "s": 1e6}[unit]
print(json.dumps({
    "seconds": float(finished.group(1)), "rps": float(finished.group(2)),
    "done": int(counts.group(3)), "succeeded": int(counts.group(4)),
    "failed": int(counts.group(5)), "errored": int(counts.group(6)),
    "timeout": int(counts.group(7)), "mean_us": us(mean.group(1)) if mean else None,
}))
PY
}

# The limiter call the Redis ceilings time (after `EVALSHA <sha>` or
# `FCALL <function>`): one fixed-window check on one of 1M keys, as
# ratekeeper sends a one-descriptor request when it is alone in its call.
LIMITER_CALL=(1 'rk:{bench_fw|user_id=key__rand_int__}:fw.3600' '' '1 1' 'fw 1000000000 3600000 0 1 1 0')

# write_limiter DIR: the limiter as ratekeeper loads it, DIR/script.lua
# (EVALSHA) and DIR/library.lua (FCALL), written by the ratekeeper binary
# (release, built by the caller; RATEKEEPER_BIN names another build of it;
# hidden flags) from the one joined text in src/store/limiter_script.rs.
write_limiter() {
    local bin=${RATEKEEPER_BIN:-target/release/ratekeeper}
    "$bin" --write-limiter-script "$1/script.lua" \
        --write-limiter-library "$1/library.lua"
}
