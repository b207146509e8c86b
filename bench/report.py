#!/usr/bin/env python3
"""Writes BENCHMARKS.md (to stdout) from bench/run.sh's results.

Usage: report.py RESULTS.jsonl RESULTS_DIR
       report.py --splice budget FROM.md INTO.md   (puts FROM's "Reserve and
       settle" section into INTO, replacing INTO's; exit 1 if FROM has none)

The page is a template filled in with medians over the rounds; ratios are
taken within each round (both sides measured minutes apart at most) and the
median of those is reported. Settings and machine facts come from the
environment run.sh exports and from /proc.
"""

import datetime
import json
import os
import platform
import re
import statistics
import sys

CLK_TCK = os.sysconf("SC_CLK_TCK")

# name -> (what it measures, store)
SCENARIOS = [
    ("memory", "in-memory store, distinct keys, 1 descriptor (fixed_window)"),
    ("memory_hot", "in-memory store, one hot key already over its limit"),
    ("memory_5desc", "in-memory store, 5 descriptors per request, distinct keys"),
    ("memory_open_half", "in-memory, **open loop** at half of the round's `memory` peak"),
    ("redis", "Redis store, distinct keys, 1 descriptor (fixed_window)"),
    ("redis_hot", "Redis store, one hot key already over its limit"),
    ("redis_5desc", "Redis store, 5 descriptors per request (one limiter call), distinct keys"),
    ("redis_open_eighth", "Redis, **open loop** at an eighth of the round's `redis` peak"),
    ("redis_open_quarter", "Redis, **open loop** at a quarter of the round's `redis` peak"),
    ("redis_open_half", "Redis, **open loop** at half of the round's `redis` peak"),
    ("memory_open_1k", "in-memory, **open loop** at 1,000 req/s: the machine's latency floor"),
    ("redis_open_1k", "Redis, **open loop** at 1,000 req/s: the machine's latency floor"),
]
# limitador-server's req/s from the issue (h2load -t1 -c16 -m32, idle machine
# of this class): the figures the h2load runs are set against.
LIMITADOR = {"memory": 61_000, "redis_exact": 15_000, "redis_batched": 24_000, "over": 17_000}
# h2load runs with the reference settings: (name, what, limitador's
# figure for the same case).
H2LOAD = [
    ("h2load_memory", "in-memory store, one fixed request (one counter, under its limit)",
     f"memory storage: ~{LIMITADOR['memory']:,}"),
    ("h2load_memory_over", "in-memory store, one fixed request over its limit", "–"),
    ("h2load_redis", "Redis store, one fixed request (one counter, under its limit)",
     f"exact Redis storage: ~{LIMITADOR['redis_exact']:,}; "
     f"approximate batched: ~{LIMITADOR['redis_batched']:,}"),
    ("h2load_redis_over", "Redis store, one fixed request over its limit",
     f"over its limit, no local cache: ~{LIMITADOR['over']:,}"),
]
ALGORITHMS = [
    ("fixed_window", "redis"),
    ("sliding_window", "redis_sw"),
    ("sliding_log", "redis_sl"),
    ("token_bucket", "redis_tb"),
    ("leaky_bucket", "redis_lb"),
]


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def fmt_int(v):
    return "–" if v is None else f"{v:,.0f}"


def fmt_ratio(v):
    return "–" if v is None else f"{v:.2f}"


def fmt_against(v, goal):
    """A ratio beside its goal: two decimals, or three where two would show
    one just short of the goal as the goal itself."""
    if v is not None and f"{v:.2f}" == f"{goal:.2f}":
        return f"{v:.3f}"
    return fmt_ratio(v)


def fmt_each(values):
    """Each round's req/s, comma-separated."""
    return ", ".join(f"{v:,.0f}" for v in values)


def measured_cells(s, errors, with_redis):
    """A scenario's req/s, each round, p50, p99, p99.9, errors and CPU cells."""
    cpu = " / ".join("–" if v is None else f"{v:.1f}"
                     for v in (s["server_cpu"], s["redis_cpu"] if with_redis else None, s["gen_cpu"]))
    return (f"{fmt_int(s['rps'])} | {fmt_each(s['rps_each'])} | {fmt_int(s['p50'])} | {fmt_int(s['p99'])} | "
            f"{fmt_int(s['p999'])} | {errors} | {cpu}")


def per_call_us(ticks, calls):
    if not calls:
        return None
    return ticks / CLK_TCK * 1e6 / calls


def script_calls(run):
    """Limiter calls Redis ran during a run (older results: EVALSHA only)."""
    return run.get("script_calls", run.get("evalsha_calls", 0))


class Results:
    def __init__(self, rows):
        self.scenarios = {}
        self.ceiling = {}
        self.h2load = {}
        self.rss = None
        self.sweep = None
        self.sliding_log_hits = []
        for r in rows:
            kind = r["kind"]
            if kind == "scenario":
                self.scenarios.setdefault(r["name"], []).append(r)
            elif kind == "h2load":
                self.h2load.setdefault(r["name"], []).append(r)
            elif kind == "redis-benchmark":
                self.ceiling.setdefault((r.get("command", "EVALSHA"), r["pipeline"]), []).append(r)
            elif kind == "rss":
                self.rss = r
            elif kind == "sweep":
                self.sweep = r
            elif kind == "sliding_log_hits":
                self.sliding_log_hits.append(r)

    def runs(self, name):
        return sorted(self.scenarios.get(name, []), key=lambda r: r["round"])

    def summary(self, name):
        runs = self.runs(name)
        if not runs:
            return None
        g = [r["gen"] for r in runs]
        return {
            "runs": len(runs),
            "rps": median([x["rps"] for x in g]),
            "rps_each": [x["rps"] for x in g],
            "p50": median([x["p50_us"] for x in g]),
            "p99": median([x["p99_us"] for x in g]),
            "p999": median([x["p999_us"] for x in g]),
            "ok": sum(x["ok"] for x in g),
            "over": sum(x["over_limit"] for x in g),
            "errors": sum(x["errors"] + x["unknown"] for x in g),
            "unsent": sum(x["unsent"] for x in g),
            "rate": median([x["rate"] for x in g]),
            "lag_p99": median([x["send_lag_p99_us"] for x in g]),
            "sent_p50": median([x.get("sent_p50_us") for x in g]),
            "sent_p99": median([x.get("sent_p99_us") for x in g]),
            "server_cpu": median([per_call_us(r["server_cpu_ticks"], r["gen"]["calls"]) for r in runs]),
            "redis_cpu": median([per_call_us(r["redis_cpu_ticks"], r["gen"]["calls"]) for r in runs]),
            "gen_cpu": median([x.get("client_cpu_us_per_req") for x in g]),
            "calls_per_req": median([script_calls(r) / max(1, r["gen"]["calls"]) for r in runs]),
        }

    def h2load_summary(self, name):
        runs = sorted(self.h2load.get(name, []), key=lambda r: r["round"])
        if not runs:
            return None
        return {
            "rps": median([r["rps"] for r in runs]),
            "rps_each": [r["rps"] for r in runs],
            "mean": median([r["mean_us"] for r in runs]),
            "done": sum(r["done"] for r in runs),
            "failed": sum(r["failed"] + r["errored"] + r["timeout"] for r in runs),
            "ok": sum(r["decided_ok"] for r in runs),
            "over": sum(r["decided_over"] for r in runs),
            "server_cpu": median([per_call_us(r["server_cpu_ticks"], r["done"]) for r in runs]),
            "redis_cpu": median([per_call_us(r["redis_cpu_ticks"], r["done"]) for r in runs]),
            "calls_per_req": median([script_calls(r) / max(1, r["done"]) for r in runs]),
        }

    def rps_by_round(self, name):
        if isinstance(name, tuple):  # a redis-benchmark run: (command, pipeline)
            return {r["round"]: float(r["rps"]) for r in self.ceiling.get(name, [])}
        if name in self.h2load:
            return {r["round"]: r["rps"] for r in self.h2load[name]}
        return {r["round"]: r["gen"]["rps"] for r in self.runs(name)}

    def ratio(self, num, den):
        """Median over rounds of num/den, and the per-round values."""
        a, b = self.rps_by_round(num), self.rps_by_round(den)
        each = [a[k] / b[k] for k in sorted(a) if k in b and b[k] > 0]
        return (median(each), each)

    def ceiling_rps(self, key):
        return median([float(r["rps"]) for r in self.ceiling.get(key, [])])


def machine():
    model, mem = "unknown", "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal"):
                    mem = f"{int(line.split()[1]) / 1048576:.1f} GiB"
                    break
    except OSError:
        pass
    return model, mem


CRATE_GROUPS = [
    ("HTTP/2 + gRPC (h2, hyper, tonic, tower, http)",
     {"h2", "hyper", "hyper_util", "tonic", "tower", "tower_layer", "tower_service", "http",
      "http_body", "http_body_util", "httparse", "want", "try_lock", "axum", "axum_core",
      "matchit", "tonic_prost"}),
    ("protobuf + buffers (prost, envoy_types, bytes)", {"prost", "envoy_types", "bytes"}),
    ("Redis client (redis-rs, combine)", {"redis", "combine"}),
    ("Tokio runtime + async plumbing (tokio, tokio_util, futures, slab)",
     {"tokio", "tokio_util", "mio", "parking_lot", "parking_lot_core", "crossbeam_utils",
      "futures_core", "futures_util", "futures_channel", "slab", "pin_project_lite"}),
    ("ratekeeper's own code (service, rules, keys, limiter, stores, config)",
     {"ratekeeper", "arc_swap"}),
    ("metrics + tracing", {"metrics", "metrics_util", "tracing", "tracing_core", "tracing_subscriber"}),
    ("std / core / hashbrown (inlined collections, fmt, hashing)",
     {"std", "core", "alloc", "hashbrown", "__rustc"}),
]
ALLOCATOR = ("malloc", "free", "_int_", "cfree", "realloc", "unlink_chunk", "tcache",
             "calloc", "sysmalloc", "__libc_malloc", "__libc_free", "arena")


def perf_rows(results_dir, store):
    """(percent, dso, symbol) rows of a `perf report --sort dso,symbol` dump."""
    path = os.path.join(results_dir, f"perf-{store}.txt")
    if not os.path.exists(path):
        return []
    rows = []
    with open(path) as f:
        for line in f:
            parts = line.split(None, 2)
            if len(parts) < 3 or not parts[0].endswith("%"):
                continue
            try:
                pct = float(parts[0].rstrip("%"))
            except ValueError:
                continue
            # perf pads the symbol column and appends "-  -" (no parent).
            sym = re.sub(r"[\s-]+$", "", parts[2])
            for tag in ("[.] ", "[k] "):
                if sym.startswith(tag):
                    sym = sym[len(tag):]
            rows.append((pct, parts[1], sym.strip()))
    return rows


def leading_crate(symbol):
    """The crate a (demangled) Rust symbol belongs to: its first path segment,
    looking past `core`/`alloc`/`std` wrappers for a more specific crate."""
    # A path's first segment: at the start, or after `<`, a space, `(`, `[`,
    # `,`, `&` or `*`.
    crates = re.findall(r"(?:^|[<\s(\[,&*])([A-Za-z_][A-Za-z0-9_]*)::", symbol)
    if not crates:
        return None
    for c in crates:
        if c not in ("core", "alloc", "std"):
            return c
    return crates[0]


def categorize(pct_rows):
    groups = {}
    for pct, dso, sym in pct_rows:
        if dso.startswith("[kernel") or dso == "[vdso]":
            g = "kernel (loopback TCP, epoll, scheduler, futex)"
        elif (dso.startswith("libc") and any(a in sym for a in ALLOCATOR)) or re.match(r"_?mi_", sym):
            g = "allocator (mimalloc; glibc malloc/free)"
        elif "memmove" in sym or "memcpy" in sym or "memset" in sym or "memcmp" in sym:
            g = "memcpy/memmove/memset"
        elif dso.startswith("libc") or dso.startswith("ld-"):
            g = "libc other (syscall wrappers, locks)"
        else:
            crate = leading_crate(sym)
            g = "other"
            for name, crates in CRATE_GROUPS:
                if crate in crates:
                    g = name
                    break
        groups[g] = groups.get(g, 0.0) + pct
    return sorted(groups.items(), key=lambda kv: -kv[1])


# The sliding log before weighted entries (one sorted-set member per hit), by
# bench/sliding_log_hits.sh with SL_LIBRARY set to the limiter of f73f9f5^
# (SL_HITS=1000000 SL_CALLS=3 SL_KEYS=1 SL_CLIENTS=1; no more calls fit in
# Redis's memory and patience): not measured again by `make bench`.
SLIDING_LOG_BEFORE = {"usec_per_call": 5_683_916, "members_per_key": 3_000_000,
                      "bytes_per_key": 386_050_512, "ping_max_us": 5_020_526}


def sliding_log_hits_section(w, rows):
    """Redis's cost of one sliding-log call, hits_addend 1 against 1,000,000."""
    if not rows:
        return
    by_hits = {}
    for r in rows:
        by_hits.setdefault(r["hits"], []).append(r)
    w("## Sliding log: hits per request (issue #19)\n")
    w("`bench/sliding_log_hits.sh` (run by `make bench` on its Redis): redis-benchmark calls "
      "the limiter function directly, 4 clients, one-check `sliding_log` requests (a limit "
      "of 4,000,000,000 per hour, so every call is admitted and stored) over 1,000 keys, "
      f"{rows[0]['calls']:,} calls per `hits_addend`, while another client sends PINGs back "
      f"to back. Medians over {min(len(v) for v in by_hits.values())} runs.\n")
    w("| `hits_addend` | Redis µs per call | 99% of calls within (µs) | slowest call within (µs) "
      "| PING p99 (µs) | PING slowest (µs) | members per key | bytes per key |")
    w("|---:|---:|---:|---:|---:|---:|---:|---:|")
    med = {}
    for hits in sorted(by_hits):
        runs = by_hits[hits]
        m = {k: median([r[k] for r in runs]) for k in
             ("usec_per_call", "call_p99_us_at_most", "slowest_call_us_at_most",
              "ping_p99_us", "ping_max_us", "members_per_key", "bytes_per_key")}
        med[hits] = m
        w(f"| {hits:,} | {m['usec_per_call']:.2f} | {fmt_int(m['call_p99_us_at_most'])} | "
          f"{fmt_int(m['slowest_call_us_at_most'])} | {fmt_int(m['ping_p99_us'])} | "
          f"{fmt_int(m['ping_max_us'])} | {m['members_per_key']:.0f} | {fmt_int(m['bytes_per_key'])} |")
    b = SLIDING_LOG_BEFORE
    w(f"| 1,000,000, before (one member per hit) | {b['usec_per_call']:,} | | | | "
      f"{b['ping_max_us']:,} | {b['members_per_key']:,} | {b['bytes_per_key']:,} |")
    w("")
    if 1 in med and 1_000_000 in med:
        ratio = med[1_000_000]["usec_per_call"] / med[1]["usec_per_call"]
        w(f"A call of 1,000,000 hits costs Redis {ratio:.2f}x a call of 1 by time (target: "
          "< 2x); counted in instructions, which this shared machine's other tenants do not "
          "disturb, the two cost about the same, within 2% (`SHAPES=\"sl_1 sl_1m\" bench/lua_instructions.sh`, "
          "`lua/README.md`). A key holds one member per admitted request, whatever its hits. "
          "The \"within\" columns are the upper bounds of Redis's `LATENCY HISTOGRAM` buckets; "
          "Redis runs one command at a time, so a call's time is how long another client can "
          "wait behind it (target: < 5 ms). 99% of calls took at most "
          f"{fmt_int(med[1_000_000]['call_p99_us_at_most'])} µs with a million hits "
          f"({fmt_int(med[1]['call_p99_us_at_most'])} with one); the slowest calls of either "
          "kind include time Redis spent preempted mid-call on this machine's busy cores, as "
          "do the PINGs, sent by a third process. The last row is the log before weighted "
          "entries (three calls on one key, one client; the PING waited until Redis answered "
          "BUSY after 5 s).\n")


# The "Reserve and settle" section's bounds, so that a run of that scenario
# alone (BENCH_SCENARIOS) can replace it in BENCHMARKS.md.
BUDGET_BEGIN, BUDGET_END = "<!-- budget:begin -->", "<!-- budget:end -->"
BUDGET_GOAL = 0.45


def budget_section(w, res, env):
    """budget_redis (a Reserve and a Settle per operation) against redis
    (one ShouldRateLimit), same round."""
    b = res.summary("budget_redis")
    if b is None:
        return
    w(BUDGET_BEGIN)
    w("## Reserve and settle (issue #23)\n")
    scenarios = env("BENCH_SCENARIOS")
    if scenarios:
        busy = env("BENCH_BACKGROUND_BUSY")
        w(f"Measured on its own: `BENCH_SCENARIOS='{scenarios}' BENCH_SECONDS={env('BENCH_SECONDS')} "
          f"BENCH_RUNS={env('BENCH_RUNS')} bench/run.sh` ({env('BENCH_DATE') or f'{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}'} UTC, "
          f"commit {env('BENCH_COMMIT', 'unknown')}, redis-server {env('BENCH_REDIS_VERSION', '?')}, "
          f"`nproc` = {os.cpu_count()}; "
          + (f"{busy}% of the machine's CPU was busy with other work in the 2 s before the run; "
             "the machine is shared, and others' work comes and goes during a run" if busy
             else "a shared machine")
          + f"). Closed loop, {env('BENCH_CONCURRENCY')} operations in flight over "
          f"{env('BENCH_CONNECTIONS')} HTTP/2 connections, {env('BENCH_THREADS')} generator "
          f"threads, {env('BENCH_WARMUP')} s warm-up then {env('BENCH_SECONDS')} s measured per "
          "run, Redis flushed before each run; in each round the selected scenarios run one after the other.\n")
    w("`budget_redis`: `ratekeeper-bench --mode budget --estimate 100 --actual 60`: each "
      "operation is one `BudgetService.Reserve` of 100 hits on one descriptor (domain `bench_fw`, "
      "a fixed window, a new `user_id` per operation) and, once granted, one `Settle` of that "
      "reservation at 60, two gRPC calls in sequence; **a reserve+settle pair counts as one "
      "operation**, its latency is the pair's. `redis`: one `ShouldRateLimit` per operation "
      "on the same keys. Both on the Redis store.\n")
    r = res.summary("redis")
    w("| scenario | operations/s (median) | each round | p50 | p99 | p99.9 | errors | "
      "CPU µs/op: ratekeeper / Redis / generator | Redis FCALL/EVALSHA calls per op |")
    w("|---|---:|---|---:|---:|---:|---:|---|---:|")
    for name, s in (("redis", r), ("budget_redis", b)):
        if s:
            w(f"| `{name}` | {measured_cells(s, s['errors'], True)} | {s['calls_per_req']:.3f} |")
    w("")
    med, each = res.ratio("budget_redis", "redis")
    if med is not None:
        met = "yes" if med >= BUDGET_GOAL else "**no**"
        w("| target | measured (median; each round) | met |")
        w("|---|---|---|")
        w(f"| reserve+settle pairs/s (`budget_redis`) / ShouldRateLimit req/s (`redis`), same round, "
          f"≥ {BUDGET_GOAL} | {fmt_against(med, BUDGET_GOAL)}; {', '.join(f'{v:.2f}' for v in each)} | {met} |")
        w("")
        if r:
            w(budget_ratio_estimates(r, b))
    if r and b["calls_per_req"] >= 1:
        w(f"Where the difference comes from: Redis ran {b['calls_per_req']:.2f} limiter calls "
          f"(`FCALL`) per reserve+settle pair against {r['calls_per_req']:.3f} per "
          "`ShouldRateLimit` request. ShouldRateLimit requests in flight together share one "
          "limiter call (`src/store/batcher.rs`); a Reserve and a Settle are each a call of their "
          f"own, so Redis spent {b['redis_cpu']:.1f} µs of CPU per pair against "
          f"{r['redis_cpu']:.1f} per request, and ratekeeper {b['server_cpu']:.1f} against "
          f"{r['server_cpu']:.1f} (two gRPC calls, and a Redis round trip each, per pair).\n")
    elif r:
        w(f"Redis calls: {b['calls_per_req']:.3f} budget or limiter calls (`FCALL`) per "
          f"reserve+settle pair against {r['calls_per_req']:.3f} per `ShouldRateLimit` request: "
          "Reserves and Settles in flight together share one call of the budget function, as "
          "ShouldRateLimit requests share the limiter's (`src/store/batcher.rs`). Per pair Redis "
          f"spent {b['redis_cpu']:.1f} µs of CPU against {r['redis_cpu']:.1f} per request, and "
          f"ratekeeper {b['server_cpu']:.1f} against {r['server_cpu']:.1f} (two gRPC calls per "
          "pair).\n")
    if b["over"]:
        w(f"{b['over']:,} Reserve calls were refused (OVER_LIMIT) in `budget_redis`.\n")
    w(BUDGET_END)
    w("")


def budget_ratio_estimates(r, b):
    """Two readings of the pair/request ratio that move less with others'
    work on the machine than a median of per-round ratios (one slow second
    in one run moves a round's ratio): the ratio of the throughput medians,
    and what the CPU allows, the three processes' CPU per request over
    theirs per pair (all three share the machine's cores)."""
    cpu = ("server_cpu", "redis_cpu", "gen_cpu")
    per_req, per_pair = (sum(s[k] or 0 for k in cpu) for s in (r, b))
    by_cpu = f"{per_req / per_pair:.2f}" if per_pair else "–"
    return (f"Read two more ways: the ratio of the medians, {b['rps'] / r['rps']:.2f}; and the "
            f"CPU all three processes spent, {per_req:.1f} µs per request against "
            f"{per_pair:.1f} per pair, {by_cpu} (the ratio if the cores were the only limit).\n")


def splice(section, source, target):
    """Replaces target's marked section with source's (or adds it before the
    soak section, or at the end). False if source has none."""
    begin, end = {"budget": (BUDGET_BEGIN, BUDGET_END)}[section]
    text = open(source).read()
    if begin not in text or end not in text:
        return False
    block = text[text.index(begin):text.index(end) + len(end)]
    try:
        page = open(target).read()
    except FileNotFoundError:
        page = ""
    if begin in page and end in page:
        page = page[:page.index(begin)] + block + page[page.index(end) + len(end):]
    elif "<!-- soak:begin -->" in page:
        at = page.index("<!-- soak:begin -->")
        page = page[:at] + block + "\n\n" + page[at:]
    else:
        page = page.rstrip("\n") + "\n\n" + block + "\n"
    with open(target, "w") as f:
        f.write(page)
    return True


def perf_section(w, results_dir, secs):
    profiles = [(store, title, perf_rows(results_dir, store)) for store, title in
                [("mem", "`memory` (in-memory store)"), ("red", "`redis` (Redis store)")]]
    profiles = [p for p in profiles if p[2]]
    if not profiles:
        w("(No profile: `perf` was not available.)\n")
        return
    w(f"`perf record -F 999 -g -p <ratekeeper>` for {secs} s under the closed-loop load "
      "of the scenario (a separate run, not part of the medians); self time grouped by where "
      "it is spent (share of ratekeeper's samples):\n")
    cats = {store: dict(categorize(rows)) for store, _, rows in profiles}
    names = []
    for store, _, _ in profiles:
        for n, _ in sorted(cats[store].items(), key=lambda kv: -kv[1]):
            if n not in names:
                names.append(n)
    w("| where | " + " | ".join(title for _, title, _ in profiles) + " |")
    w("|---|" + "---:|" * len(profiles))
    for n in names:
        w(f"| {n} | " + " | ".join(f"{cats[store].get(n, 0.0):.1f}%" for store, _, _ in profiles) + " |")
    w("")
    for store, title, rows in profiles:
        w(f"Top symbols, {title}:\n")
        w("```")
        for pct, dso, sym in rows[:14]:
            w(f"{pct:6.2f}%  {dso:<18} {sym[:110]}")
        w("```\n")


def main():
    if sys.argv[1] == "--splice":
        sys.exit(0 if splice(*sys.argv[2:5]) else 1)
    results_path, results_dir = sys.argv[1], sys.argv[2]
    res = Results(load(results_path))
    env = os.environ.get
    model, mem = machine()
    secs = env("BENCH_SECONDS", "5")
    out = []
    w = out.append

    w("# Benchmarks\n")
    w("Generated by `make bench` (`bench/run.sh`, report by `bench/report.py`); "
      "do not edit by hand — rerun it.\n")
    w("| | |\n|---|---|")
    w(f"| command | `make bench` (BENCH_SECONDS={secs} BENCH_WARMUP={env('BENCH_WARMUP')} "
      f"BENCH_RUNS={env('BENCH_RUNS')} BENCH_CONCURRENCY={env('BENCH_CONCURRENCY')} "
      f"BENCH_CONNECTIONS={env('BENCH_CONNECTIONS')} BENCH_THREADS={env('BENCH_THREADS')} "
      f"BENCH_REDIS_POOL={env('BENCH_REDIS_POOL')}) |")
    # BENCH_DATE: when the report is rewritten from earlier results.
    date = env("BENCH_DATE") or f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
    w(f"| date | {date} UTC |")
    w(f"| commit | {env('BENCH_COMMIT', 'unknown')} |")
    w(f"| machine | `nproc` = {os.cpu_count()}, {model}, {mem} RAM, Linux {platform.release()} |")
    busy = env("BENCH_BACKGROUND_BUSY")
    if busy:
        w(f"| other load | {busy}% of the machine's CPU was busy with other work in the 2 s before the run |")
    w(f"| ratekeeper | release build (`lto`, `codegen-units = 1`); {os.cpu_count()} serving threads "
      "(the default, one per core: `src/lanes.rs`); Redis store with "
      f"{env('BENCH_REDIS_POOL')} connections in all, spread over them |")
    w(f"| Redis | redis-server {env('BENCH_REDIS_VERSION', '?')}, own process on a free loopback port, no persistence |")
    w("| generators | `ratekeeper-bench` (tonic client of Envoy RLS v3; each of its threads a "
      "single-threaded runtime with its own connections and share of the load, open loop paced "
      "by a `timerfd`) and, for the issue's "
      f"reference settings, h2load {env('BENCH_H2LOAD_VERSION', '?')}; both on the same machine |")
    w("")
    w("Everything — generator, ratekeeper and redis-server — runs on the same "
      f"{os.cpu_count()} cores, all traffic on 127.0.0.1. Each run: {env('BENCH_WARMUP')} s "
      f"warm-up, then {secs} s measured; closed loop with {env('BENCH_CONCURRENCY')} requests "
      f"in flight over {env('BENCH_CONNECTIONS')} HTTP/2 connection(s) unless marked open loop. "
      f"Every scenario ran {env('BENCH_RUNS')} times in rounds (a round runs every scenario "
      "once); the tables give medians, ratios are computed within each round and their median "
      "is shown. Redis is flushed before every Redis run. Latencies in µs (HDR histogram); open "
      "loop latencies are measured from each request's intended send time.\n")

    # --- scenarios ---------------------------------------------------------------
    w("## Scenarios\n")
    w("| scenario | what | req/s (median) | req/s each round | p50 | p99 | p99.9 | errors | "
      "CPU µs/req: ratekeeper / Redis / generator |")
    w("|---|---|---:|---|---:|---:|---:|---:|---|")
    for name, what in SCENARIOS:
        s = res.summary(name)
        if s is None:
            continue
        errors = str(s["errors"]) + (f" (+{s['unsent']} unsent)" if s["unsent"] else "")
        if s["rate"]:
            what += (f" ({s['rate']:,.0f} req/s; generator's send lag p99 {fmt_int(s['lag_p99'])} µs; "
                     f"from the actual send: p50 {fmt_int(s['sent_p50'])}, p99 {fmt_int(s['sent_p99'])} µs)")
        if s["over"]:
            what += f"; {s['over']:,} OVER_LIMIT answers"
        w(f"| `{name}` | {what} | {measured_cells(s, errors, name.startswith('redis'))} |")
    w("")

    w("### Each algorithm on Redis (distinct keys, 1 descriptor)\n")
    w("| algorithm | req/s (median) | req/s each round | p50 | p99 | p99.9 | errors | "
      "CPU µs/req: ratekeeper / Redis / generator |")
    w("|---|---:|---|---:|---:|---:|---:|---|")
    for algorithm, name in ALGORITHMS:
        s = res.summary(name)
        if s is None:
            continue
        w(f"| `{algorithm}` | {measured_cells(s, s['errors'], True)} |")
    w("")

    # --- the Redis ceiling -----------------------------------------------------------
    w("### Redis ceiling: the limiter alone\n")
    w("`redis-benchmark -c 50 -r 1000000 [-P 16] EVALSHA <sha> 1 'rk:{bench_fw|user_id=key__rand_int__}:fw.3600' "
      "\"\" '1 1' 'fw 1000000000 3600000 0 1 1'`, and the same with `FCALL <function>` — the limiter "
      "ratekeeper loads (`lua/prelude.lua` … `lua/batch.lua`) as a script, and as the function "
      "library ratekeeper calls on Redis 7 (`ratekeeper --write-limiter-library`), one "
      "fixed-window check per call, as ratekeeper sends a one-descriptor request when it is the "
      "only one waiting (under load ratekeeper joins the requests in flight into fewer, larger "
      "calls; see the calls per request below).\n")
    w("| redis-benchmark | req/s (median) | req/s each round |")
    w("|---|---:|---|")
    for command, p in sorted(res.ceiling):
        runs = sorted(res.ceiling[(command, p)], key=lambda r: r["round"])
        each = ", ".join(f"{float(r['rps']):,.0f}" for r in runs)
        w(f"| `{command} -c 50 -P {p}` | {fmt_int(res.ceiling_rps((command, p)))} | {each} |")
    single, piped = res.ratio(("FCALL", 1), ("EVALSHA", 1)), res.ratio(("FCALL", 16), ("EVALSHA", 16))
    if single[0] is not None:
        w("")
        w(f"FCALL / EVALSHA, same round: {fmt_ratio(single[0])} unpipelined "
          f"({', '.join(f'{v:.2f}' for v in single[1])}), {fmt_ratio(piped[0])} with `-P 16` "
          f"({', '.join(f'{v:.2f}' for v in piped[1])}).")
    w("")

    # --- h2load: the reference settings ----------------------------------------
    if res.h2load:
        w("### The issue's reference settings: h2load, one fixed request\n")
        w(f"`h2load -t1 -c16 -m32 -D{secs} -d <request> -H 'content-type: application/grpc' "
          "-H 'te: trailers' http://<ratekeeper>/envoy.service.ratelimit.v3.RateLimitService/"
          "ShouldRateLimit` — the generator settings the issue's limitador-server figures were "
          "measured with (on an idle machine of this class; ours share the machine with other "
          "tenants). `<request>` is one `ShouldRateLimit` request, gRPC-framed, written by "
          "`ratekeeper-bench --write-request` (domain `bench_fw`, `user_id` `k0`, or `hot` for "
          "the over-limit runs). h2load sees every gRPC answer as HTTP 200, so the answers "
          "ratekeeper counted in its own metrics (`ratekeeper_rate_limit_total_hits` less "
          "`_over_limit`, and `_over_limit`) are shown beside h2load's count: they match up to the requests still "
          "in flight when h2load stopped. No warm-up; the in-memory store is restarted and "
          "Redis flushed before each run.\n")
        w("| scenario | what | req/s (median) | req/s each round | mean latency µs | "
          "h2load: done / failed | ratekeeper answered: OK / over limit | "
          "CPU µs/req: ratekeeper / Redis | limitador-server (issue, req/s) |")
        w("|---|---|---:|---|---:|---|---|---|---|")
        for name, what, reference in H2LOAD:
            h = res.h2load_summary(name)
            if h is None:
                continue
            redis_cpu = f"{h['redis_cpu']:.1f}" if name.startswith("h2load_redis") else "–"
            w(f"| `{name}` | {what} | {fmt_int(h['rps'])} | {fmt_each(h['rps_each'])} | {fmt_int(h['mean'])} | "
              f"{h['done']:,} / {h['failed']:,} | {h['ok']:,} / {h['over']:,} | "
              f"{h['server_cpu']:.1f} / {redis_cpu} | {reference} |")
        w("")
        hr = res.h2load_summary("h2load_redis")
        if hr:
            w(f"In `h2load_redis` every request of a call is on the same counter, which the "
              f"limiter script reads and writes once per call: {hr['calls_per_req']:.3f} "
              "script calls per request.\n")

    # --- ratios and targets -----------------------------------------------------------
    w("## Ratios and targets (issue #6)\n")
    w("Ratios are per round (same minute, same machine state), median over the rounds.\n")
    w("| target | measured (median; each round) | met |")
    w("|---|---|---|")

    def ratio_row(label, num, den, goal):
        med, each = res.ratio(num, den)
        met = "–" if med is None else ("yes" if med >= goal else "**no**")
        w(f"| {label} ≥ {goal} | {fmt_against(med, goal)}; {', '.join(f'{v:.2f}' for v in each)} | {met} |")

    ratio_row("Redis (`redis`) / in-memory (`memory`) throughput, this generator, distinct keys",
              "redis", "memory", 0.6)
    if res.h2load:
        ratio_row("Redis (`h2load_redis`) / in-memory (`h2load_memory`) throughput, h2load, "
                  "one fixed request", "h2load_redis", "h2load_memory", 0.6)
    ratio_row("Redis (`redis`) / `redis-benchmark -c 50 -P 1` EVALSHA", "redis", ("EVALSHA", 1), 0.4)
    ratio_row("hot key over limit on Redis (`redis_hot`) / in-memory (`memory`)", "redis_hot", "memory", 0.9)
    ratio_row("hot key over limit in memory (`memory_hot`) / `memory`", "memory_hot", "memory", 0.9)
    hm = res.h2load_summary("h2load_memory")
    if hm:
        met = "yes" if hm["rps"] > LIMITADOR["memory"] else "**no**"
        w(f"| in-memory req/s > limitador's {LIMITADOR['memory']:,}, same h2load settings "
          f"(`h2load_memory`; theirs on an idle machine) | {fmt_int(hm['rps'])}; "
          f"{fmt_each(hm['rps_each'])} | {met} |")
    mem = res.summary("memory")
    if mem:
        w(f"| (for scale: in-memory req/s with this generator, distinct keys; the generator "
          f"takes about half the CPU) | {fmt_int(mem['rps'])} | – |")
    hr = res.h2load_summary("h2load_redis")
    if hr:
        met = "yes" if hr["rps"] > max(LIMITADOR["redis_exact"], LIMITADOR["redis_batched"]) else "**no**"
        w(f"| Redis req/s (`h2load_redis`, exact) > limitador's exact {LIMITADOR['redis_exact']:,} "
          f"and batched {LIMITADOR['redis_batched']:,} | "
          f"{fmt_int(hr['rps'])} | {met} |")
    ho = res.h2load_summary("h2load_redis_over")
    if ho:
        met = "yes" if ho["rps"] > LIMITADOR["over"] else "**no**"
        w(f"| over-limit key on Redis (`h2load_redis_over`) > limitador's {LIMITADOR['over']:,} | "
          f"{fmt_int(ho['rps'])} | {met} |")
    op = res.summary("redis_open_half")
    if op:
        met = "yes" if op["p99"] <= 1000 else "**no**"
        w(f"| p99 ≤ 1 ms at half of peak, open loop, Redis | p99 {op['p99']} µs at "
          f"{op['rate']:,.0f} req/s | {met} |")
    eighth = res.summary("redis_open_eighth")
    if op and eighth:
        w(f"| (for scale: p99 at an eighth of peak, open loop, Redis) | p99 {eighth['p99']} µs at "
          f"{eighth['rate']:,.0f} req/s | – |")
    floor = res.summary("redis_open_1k")
    if op and floor:
        w(f"| (for scale: p99 at 1,000 req/s, open loop, Redis — far below any peak) | "
          f"p99 {floor['p99']} µs, p50 {floor['p50']} µs | – |")
    w("")
    w("Other ratios (median; each round):\n")
    for label, num, den in [
        ("`redis` / `redis-benchmark EVALSHA -P 16`", "redis", ("EVALSHA", 16)),
        ("`redis` / `redis-benchmark FCALL -P 1` (the call ratekeeper makes)", "redis", ("FCALL", 1)),
        ("`redis` / `redis-benchmark FCALL -P 16`", "redis", ("FCALL", 16)),
        ("`redis_5desc` / `memory_5desc`", "redis_5desc", "memory_5desc"),
        ("`redis_5desc` / `redis` (requests; each carries 5 checks)", "redis_5desc", "redis"),
        ("`memory_5desc` / `memory`", "memory_5desc", "memory"),
    ]:
        med, each = res.ratio(num, den)
        w(f"- {label}: {fmt_ratio(med)} ({', '.join(f'{v:.2f}' for v in each)})")
    w("")

    budget_section(w, res, env)

    # --- memory -------------------------------------------------------------------
    w("## Memory (in-memory store)\n")
    if res.rss:
        r = res.rss
        grown = (r["after_kib"] - r["before_kib"]) * 1024
        per_key = grown / max(r["keys"], 1)
        ok = r["gen"]["ok"]
        verdict = "meets" if per_key < 200 else "**misses**"
        w(f"A fresh ratekeeper (in-memory store, metrics endpoint off so that the latency "
          f"histogram's samples, kept up to 5 s between upkeeps, are not counted against the "
          f"keys) was sent {r['keys']:,} requests, each with a "
          f"new `user_id` value (about {len('%x-' % (2**60)) + 7} characters) under a one-day "
          f"fixed window, so every request created one live counter ({ok:,} answered OK, "
          f"{r['gen']['errors']} errors). Resident set size (`VmRSS`):\n")
        w("| | VmRSS |")
        w("|---|---:|")
        w(f"| idle, after start-up | {r['before_kib'] / 1024:,.1f} MiB |")
        w(f"| with {r['keys']:,} live counters | {r['after_kib'] / 1024:,.1f} MiB |")
        w(f"| **per key** | **{per_key:,.0f} bytes** ({verdict} the < 200 B/key target) |")
        w("")
        w("Per key this holds one hash-table entry — the key's 128-bit digest (the counter key "
          "itself, e.g. `rk:{bench_mem|user_id=18a9f3c2d4e5f6a7-123456}:fw.86400`, about 55 "
          "bytes, is not kept: `src/store/memory.rs`), the counter state and its expiry, 56 "
          "bytes, plus a control byte — in one of 64 shards, a table that doubles when full, so "
          "at a given count it may be only half occupied (at a million keys each shard holds "
          "15,625 entries in 32,768 buckets: about 120 bytes per key of table), and the "
          "allocator's and the process's overhead.\n")
    if res.sweep:
        sw = res.sweep
        samples = sw["samples_kib"]
        n = len(samples)
        g = sw["gen"]
        w(f"**Expired counters are swept.** A fresh ratekeeper received a stream of distinct "
          f"keys at {sw['rate']:,} req/s for {sw['seconds']} s (open loop; {g['requests']:,} "
          f"requests, {g['errors']} errors, {g['unsent']} unsent) under one-second windows "
          f"(`bench/limits/bench_short.yaml`). Counters expire a second after their window "
          f"and a sweeper visits every shard within 4 s, so about {sw['rate'] * 5:,} counters "
          f"at most should be live at a time; without sweeping all {g['requests']:,} would "
          f"stay. VmRSS once a second (MiB; {sw['base_kib'] / 1024:.1f} before the stream):\n")
        w("```")
        line = []
        for i, kib in enumerate(samples, 1):
            line.append(f"{i:>3}s {kib / 1024:7.1f}")
            if len(line) == 5:
                w("   ".join(line))
                line = []
        if line:
            w("   ".join(line))
        w("```")
        if n >= 8:
            bpk = per_key if res.rss else 300
            unswept = sw["rate"] * bpk / 1048576
            early = (samples[4] - sw["base_kib"]) / 1024 / 5
            q = (3 * n) // 4 - 1
            late = (samples[-1] - samples[q]) / 1024 / (n - 1 - q)
            half = samples[n // 2 - 1]
            w(f"\nVmRSS grew {early:.2f} MiB/s over the first 5 s (the live set filling up), "
              f"{(samples[-1] - half) / 1024:+.1f} MiB over the second half, and "
              f"{late:.2f} MiB/s over the last quarter — against {unswept:.1f} MiB/s had nothing "
              f"been swept ({sw['rate']:,} new keys/s × {bpk:.0f} bytes/key), which would have "
              f"reached about {sw['rate'] * sw['seconds'] * bpk / 1048576:,.0f} MiB; the peak was "
              f"{max(samples) / 1024:.1f} MiB. The slow creep that remains is the shards' hash "
              "tables keeping the capacity of their busiest moment (they never shrink) and "
              "allocator fragmentation; it flattens as the tables reach the size of the peak "
              "live set.\n")

    # --- where the time goes ------------------------------------------------------------
    w("## Where the time goes\n")
    m, r = res.summary("memory"), res.summary("redis")
    if m and r:
        w(f"CPU per request (µs, median), measured from `/proc/PID/stat` over each run, warm-up "
          "included, divided by the calls made:\n")
        w("| scenario | ratekeeper | redis-server | generator | sum | script calls per request |")
        w("|---|---:|---:|---:|---:|---:|")
        for name in ["memory", "memory_hot", "memory_5desc", "redis", "redis_hot", "redis_5desc"]:
            s = res.summary(name)
            if not s:
                continue
            rd = s["redis_cpu"] if name.startswith("redis") else 0.0
            parts = [s["server_cpu"], rd, s["gen_cpu"]]
            total = sum(p for p in parts if p is not None)
            calls = f"{s['calls_per_req']:.3f}" if name.startswith("redis") else "–"
            w(f"| `{name}` | {s['server_cpu']:.1f} | {rd:.1f} | {s['gen_cpu']:.1f} | {total:.1f} | {calls} |")
        for name in ["h2load_memory", "h2load_redis"]:
            h = res.h2load_summary(name)
            if not h:
                continue
            rd = h["redis_cpu"] if name == "h2load_redis" else 0.0
            calls = f"{h['calls_per_req']:.3f}" if name == "h2load_redis" else "–"
            w(f"| `{name}` (one counter) | {h['server_cpu']:.1f} | {rd:.1f} | – (h2load) | "
              f"{h['server_cpu'] + rd:.1f} + h2load | {calls} |")
        w("")
        w("Script calls per request: limiter calls (`FCALL`, or `EVALSHA` where Redis has no functions) Redis ran (`INFO commandstats`) over "
          "the requests the generator made, warm-up included. Below 1, ratekeeper joined "
          "requests that were in flight together into one call (`src/store/batcher.rs`); "
          "`redis_hot` makes almost none, its answers come from the over-limit cache.\n")
        cores = os.cpu_count() or 2
        w(f"With {cores} cores the machine can spend at most {cores * 1e6:,.0f} CPU-µs per "
          "second, so the sum column bounds the throughput this box can reach in a "
          f"closed loop: about {cores * 1e6 / max(1e-9, m['server_cpu'] + m['gen_cpu']):,.0f} "
          f"req/s for `memory` and {cores * 1e6 / max(1e-9, r['server_cpu'] + r['redis_cpu'] + r['gen_cpu']):,.0f} "
          "for `redis` if nothing else ran (other tenants' load comes off that). The generator's "
          "share is paid in every scenario alike, which is why ratios within a round are the "
          "comparable numbers; absolute req/s are those of the whole box.\n")
    sliding_log_hits_section(w, res.sliding_log_hits)
    perf_section(w, results_dir, secs)

    w("## What limits these numbers\n")
    m, r = res.summary("memory"), res.summary("redis")
    cores = os.cpu_count() or 2
    if m and r:
        w(f"- **{cores} shared cores.** The generator, ratekeeper and redis-server compete for "
          f"the same cores, and other tenants' work comes and goes: `memory` ranged "
          f"{min(m['rps_each']):,.0f}–{max(m['rps_each']):,.0f} req/s and `redis` "
          f"{min(r['rps_each']):,.0f}–{max(r['rps_each']):,.0f} req/s across the rounds. "
          "Absolute numbers are those of the whole box and noisy; the ratios within a round "
          "are the comparable figures.")
        w(f"- **The generator is not free.** The tonic client spent {m['gen_cpu']:.1f} µs of CPU "
          f"per call in `memory` (ratekeeper: {m['server_cpu']:.1f}) and {r['gen_cpu']:.1f} µs "
          f"in `redis` — {m['gen_cpu'] / (m['gen_cpu'] + m['server_cpu']):.0%} of the CPU the "
          "two used in the in-memory case. It is paid in every scenario (more where Redis "
          "shares the cores too), so it lowers them all; run it on another host for capacity "
          "numbers.")
    cats = {store: dict(categorize(perf_rows(results_dir, store))) for store in ("mem", "red")}
    if cats["mem"]:
        c = cats["mem"]
        plumbing = sum(v for k, v in c.items() if k.startswith(("kernel", "HTTP/2", "allocator",
                                                                    "memcpy", "Tokio", "protobuf")))
        own = c.get("ratekeeper's own code (service, rules, keys, limiter, stores, config)", 0.0)
        w(f"- **Transport, not the limiter.** In the `memory` profile, {plumbing:.0f}% of "
          "ratekeeper's samples are loopback TCP, HTTP/2, Tokio, protobuf, copying and the "
          f"allocator, and {own:.0f}% are ratekeeper's own functions (plus inlined hashing and "
          "maps). The allocator alone is "
          f"{c.get('allocator (mimalloc; glibc malloc/free)', 0.0):.0f}%.")
    if r and r["redis_cpu"]:
        busy = r["redis_cpu"] * max(r["rps_each"]) / 1e6
        w(f"- **Redis runs Lua single-threaded.** The script took {r['redis_cpu']:.1f} µs of "
          f"Redis CPU per one-descriptor request, so Redis used about {busy:.0%} of a core at "
          f"the best `redis` round: it is not yet the bottleneck here; the CPU left for "
          "ratekeeper and the generator is.")
    hm, hr = res.h2load_summary("h2load_memory"), res.h2load_summary("h2load_redis")
    if hm and hr and cats["red"]:
        alloc = "allocator (mimalloc; glibc malloc/free)"
        w(f"- **Next: ratekeeper's own Redis path, then the Lua.** With h2load on one counter, "
          f"Redis spent {hr['redis_cpu']:.1f} µs per request (its key read and written once per "
          f"call) while ratekeeper spent {hr['server_cpu']:.1f} µs, against "
          f"{hm['server_cpu']:.1f} µs with the in-memory store. The Redis client itself is "
          f"{cats['red'].get('Redis client (redis-rs, combine)', 0.0):.1f}% of the `redis` "
          "profile and the allocator "
          f"{cats['red'].get(alloc, 0.0):.0f}% (in-memory: "
          f"{cats['mem'].get(alloc, 0.0):.0f}%). A request no longer leaves its thread (each "
          "core serves its connections with its own Redis connections and batcher, "
          "`src/lanes.rs`); what the Redis path still adds per request is the hand-off to the "
          "batcher (a channel and a copy of the checks; no timer of its own), the command's encoding "
          "and the reply's parsing, and the wait itself: an in-memory answer is written in the "
          "same poll of the HTTP/2 and gRPC layers that read the request, a Redis one in a "
          "second poll once the reply is in. In Redis, a check on a new key in a call of 23 "
          "costs about 49,000 instructions (`bench/lua_instructions.sh`, callgrind): some "
          "10,500 are the three Redis commands themselves (`HMGET`, `HSET`, `PEXPIRE`), 9,500 "
          "calling them from Lua (their arguments made Redis strings, the command looked up, "
          "the reply turned back into Lua values), 6,500 the call's own arguments, reply and "
          "networking, and 23,000 the Lua interpreter running the algorithm's generic steps "
          "(a table per state and per reply, a function call per step, the garbage they "
          "leave).")
    q = res.summary("redis_open_quarter")
    if q and r:
        w(f"- **Open loop on a VM.** At a quarter of the peak, ratekeeper spent "
          f"{q['server_cpu']:.0f} µs of CPU per request (vs {r['server_cpu']:.0f} at full load): "
          "with no batching every request pays its own thread wake-ups, which are costly on "
          f"this virtual machine. The generator's own send lag (p99 {fmt_int(q['lag_p99'])} µs "
          "at that rate) shows the scheduling delay every process here sees; the p99 from the "
          "intended send time includes it.")
    h = res.summary("redis_open_half")
    if h and r:
        def cpu_per_request(x):
            return x["server_cpu"] + x["redis_cpu"] + x["gen_cpu"]

        def busy(x):
            return cpu_per_request(x) * x["rps"] / (cores * 1e6)

        loads = [(label, res.summary(name)) for label, name in
                 [("an eighth", "redis_open_eighth"), ("a quarter", "redis_open_quarter"),
                  ("half", "redis_open_half")]]
        shares = ", ".join(f"{busy(x):.0%} at {label} ({x['p99']:,} µs p99)"
                           for label, x in loads if x)
        w(f"- **Half of the peak is not half of the machine.** At half of the closed-loop peak "
          f"({fmt_int(h['rps'])} req/s, open loop) the three processes spent "
          f"{cpu_per_request(h):.0f} µs of CPU per request against {cpu_per_request(r):.0f} at "
          "the peak, where requests share Redis calls and wake-ups, and every wake-up of a "
          f"thread costs microseconds on this virtual machine. The {cores} cores were busy "
          f"about {shares} of the peak. A request passes through five threads in turn "
          "(generator, ratekeeper, Redis, ratekeeper, generator), each of which may wait for a "
          "core held by another process: that queueing, not the decision, is the p99 here. The "
          "same rate from a generator on another host would leave ratekeeper and Redis the "
          "whole machine.")
    w("")
    w(f"Raw results: `target/bench/results.jsonl` (one JSON object per run).")
    print("\n".join(out))


if __name__ == "__main__":
    main()
