#!/usr/bin/env python3
"""The soak run's report (bench/soak.sh calls it): reads the run's work
directory and writes a "Soak run" section, between the markers below, into
BENCHMARKS.md (replacing the previous one; `make bench` carries it over).

    soak_report.py WORK OUT COMMAND SECONDS AUDIT_LIMIT DEADLINE_MS

WORK holds: events.tsv (name, unix ms, detail: what the harness did when),
rss.tsv (unix ms, replica, VmRSS KiB), timeline.jsonl and audit.jsonl (from
ratekeeper-soak), store_audit.tsv (the audit counters on the final primary),
replicas.tsv (replica, alive at the end, panics in its stderr), rkN.metrics.
OUT "-" prints the section only.

Over-admission, defined: an audit value has AUDIT_LIMIT admissions per
one-minute window (fixed windows on the Unix epoch; each answer names its
window by its time until reset). OK answers decided by the store (not
carrying ratekeeper.store_error) are counted per value, window and *store
lineage*: lineage 1 is Redis A until it is SIGKILLed (calls sent before the
kill completed); lineage 2 is the restarted, empty A and, after the
failover, B, which had replicated it (calls sent after the kill). A lineage
starting empty may admit the limit again: that is not over-admission. The
failover can lose what A admitted after B stopped copying it: calls sent
from one deadline before the fence (B acknowledged all writes until then)
to A's demotion are the allowance for that. Over-admissions = per value,
window and lineage, admissions decided by the store beyond the limit plus
that allowance. OK answers given by the failure mode (Redis unreachable,
failure mode `open`) are counted apart: they are the configured answer to
an outage, not the store over-admitting. After the run the final primary's
counter for each value's last window is compared with the answers seen
(answers seen <= counted <= limit: a call the store admitted whose answer
came too late for the generator is counted but not seen).
"""

import json
import os
import sys
import time
from collections import defaultdict

BEGIN = "<!-- soak:begin -->"
END = "<!-- soak:end -->"
AUDIT_WINDOW_MS = 60_000
WARMUP_SECONDS = 60
RLS_FIELDS = ("store_ok", "store_over", "without_store", "errors", "late", "skipped")
LEASE_FIELDS = ("lease_granted", "lease_refused", "lease_errors", "heartbeat_extended",
                "heartbeat_lost", "lease_late")


def read_tsv(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [line.rstrip("\n").split("\t") for line in f if line.strip()]


def read_jsonl(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def events_of(work):
    events = {}
    for row in read_tsv(os.path.join(work, "events.tsv")):
        detail = row[2] if len(row) > 2 else ""
        events.setdefault(row[0], []).append((int(row[1]), detail))
    return events


def first(events, name):
    return events[name][0][0] if name in events else None


# --- answers, by phase ----------------------------------------------------------

def phases(events):
    """(name, start ms, end ms) of each phase the harness made."""
    cuts = [("before the kill", first(events, "start"))]
    if first(events, "kill"):
        cuts.append(("after the kill and restart", first(events, "kill")))
    if first(events, "switch"):
        cuts.append(("after the failover", first(events, "switch")))
    end = first(events, "end")
    return [(name, at, cuts[i + 1][1] if i + 1 < len(cuts) else end)
            for i, (name, at) in enumerate(cuts)]


def sum_rows(rows):
    total = defaultdict(int)
    for row in rows:
        for field in RLS_FIELDS + LEASE_FIELDS:
            total[field] += row.get(field, 0)
    return total


def answered(t):
    return t["store_ok"] + t["store_over"] + t["without_store"] + t["errors"]


def share(part, whole):
    return f"{100 * part / whole:.1f}%" if whole else "-"


def phase_table(timeline, events, deadline_ms):
    lines = [
        "| phase | seconds | calls | decided by Redis or its over-limit cache (ok / over) "
        "| by the failure mode "
        f"| errors | later than {deadline_ms} ms | leases granted / refused / errors / lost |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, start, end in phases(events):
        # A second belongs to the phase holding its middle.
        t = sum_rows(r for r in timeline if start <= r["t"] * 1000 + 500 < end)
        calls, by_store = answered(t), t["store_ok"] + t["store_over"]
        lines.append(
            f"| {name} | {(end - start) / 1000:.0f} | {calls} "
            f"| {by_store} ({share(by_store, calls)}: {t['store_ok']} / {t['store_over']}) "
            f"| {t['without_store']} ({share(t['without_store'], calls)}) | {t['errors']} "
            f"| {t['late']} | {t['lease_granted']} / {t['lease_refused']} / "
            f"{t['lease_errors']} / {t['heartbeat_lost']} |")
    return lines


def series(timeline, events, step=10):
    """The share of calls decided by Redis (or the over-limit cache), per
    `step` seconds of the run, and the step each event fell in."""
    start, end = first(events, "start"), first(events, "end")
    buckets = defaultdict(lambda: defaultdict(int))
    for row in timeline:
        i = (row["t"] * 1000 + 500 - start) // (1000 * step)
        if 0 <= i and start + i * step * 1000 < end:
            for field in ("store_ok", "store_over", "without_store", "errors"):
                buckets[i][field] += row.get(field, 0)
    marks = defaultdict(list)
    for name in ("kill", "switch"):
        if first(events, name):
            marks[(first(events, name) - start) // (1000 * step)].append(name)
    cells = []
    for i in sorted(buckets):
        b = buckets[i]
        cell = share(b["store_ok"] + b["store_over"], answered(b))
        cells.append(" ".join(f"[{m}]" for m in marks.get(i, [])) + (" " if i in marks else "") + cell)
    return (f"Share of calls decided by Redis or its over-limit cache, per {step} s "
            f"([kill]: Redis A killed and restarted; [switch]: the failover): " + ", ".join(cells) + ".")


def back_on_store(timeline, since_ms, end_ms):
    """Seconds from since_ms until the first of three seconds in a row answered
    by Redis alone (no failure-mode answers, no errors); None if never."""
    per_second = defaultdict(lambda: defaultdict(int))
    for row in timeline:
        for field in ("store_ok", "store_over", "without_store", "errors"):
            per_second[row["t"]][field] += row.get(field, 0)

    def clean(t):
        c = per_second.get(t)
        return c is not None and c["without_store"] == 0 and c["errors"] == 0 \
            and c["store_ok"] + c["store_over"] > 0

    for t in sorted(t for t in per_second if since_ms <= t * 1000 < end_ms):
        if all(clean(t + i) for i in range(3)):
            return max(0.0, (t * 1000 - since_ms) / 1000)
    return None


def recoveries(timeline, events):
    start, end = first(events, "start"), first(events, "end")
    lines = []
    for name, label in (("restart", "Redis A was restarted"),
                        ("switch", "the address moved to B")):
        at = first(events, name)
        if at is None:
            continue
        back = back_on_store(timeline, at, end)
        lines.append(
            f"- after {label} (at {(at - start) / 1000:.0f} s): "
            + (f"answers from Redis alone again after {back:.0f} s" if back is not None
               else f"**no answers from Redis alone again** in the {(end - at) / 1000:.0f} s left"))
    return lines


# --- memory -------------------------------------------------------------------

def memory_table(work, events, seconds):
    samples = defaultdict(list)
    for ms, replica, kib in read_tsv(os.path.join(work, "rss.tsv")):
        samples[int(replica)].append((int(ms), int(kib)))
    start = first(events, "start")
    warmup = min(WARMUP_SECONDS, seconds * 0.1)
    middle = start + 1000 * seconds / 2
    lines = [
        f"| replica | start (after {warmup:.0f} s warm-up) | middle | end "
        "| growth after warm-up | peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    growths = []
    for replica in sorted(samples):
        s = sorted(samples[replica])
        at_start = ([k for ms, k in s if ms >= start + 1000 * warmup] or [s[0][1]])[0]
        at_middle = min(s, key=lambda x: abs(x[0] - middle))[1]
        at_end = s[-1][1]
        growth = (at_end - at_start) / at_start if at_start else 0.0
        growths.append(growth)
        lines.append(f"| {replica} | {mib(at_start)} | {mib(at_middle)} | {mib(at_end)} "
                     f"| {100 * growth:+.1f}% | {mib(max(k for _, k in s))} |")
    return lines, growths


def mib(kib):
    return f"{kib / 1024:.1f} MiB"


# --- over-admission -----------------------------------------------------------

def count_admissions(work, events, deadline_ms):
    """Admissions decided by the store per (lineage, value, window), those of
    them in the failover gap, and the ones counted apart."""
    kill = first(events, "kill")
    fence, demote = first(events, "fence"), first(events, "demote")
    gap = (fence - deadline_ms, demote) if fence and demote else None
    counted, allowance = defaultdict(int), defaultdict(int)
    by_failure_mode = unattributed = 0
    for a in read_jsonl(os.path.join(work, "audit.jsonl")):
        if not a["from_store"]:
            by_failure_mode += 1
            continue
        if a.get("window_end_ms") is None:
            unattributed += 1
            continue
        window = round(a["window_end_ms"] / AUDIT_WINDOW_MS) - 1
        key = (1 if kill is None or a["sent_ms"] < kill else 2, a["value"], window)
        counted[key] += 1
        if gap and gap[0] <= a["sent_ms"] <= gap[1]:
            allowance[key] += 1
    return counted, allowance, by_failure_mode, unattributed


def audit_table(counted, allowance, limit):
    over = {k: n - limit - allowance[k] for k, n in counted.items()
            if n > limit + allowance[k]}
    lines = [
        "| store lineage | value-windows with admissions | of which at the limit "
        "| admitted by Redis | failover-gap allowance | over-admissions |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for lineage, name in ((1, "1: A until the kill"), (2, "2: A restarted, then B")):
        keys = [k for k in counted if k[0] == lineage]
        lines.append(
            f"| {name} | {len(keys)} | {sum(1 for k in keys if counted[k] >= limit)} "
            f"| {sum(counted[k] for k in keys)} | {sum(allowance[k] for k in keys)} "
            f"| {sum(v for k, v in over.items() if k[0] == lineage)} |")
    return lines, sum(over.values())


def store_comparison(work, counted, allowance, limit):
    """The final primary's counter of each audit value against the answers
    seen in that window of lineage 2 (less those of the failover gap, which
    only A counted)."""
    lines, mismatches = [], 0
    for row in read_tsv(os.path.join(work, "store_audit.tsv")):
        fields = row[1].split() if len(row) > 1 else []
        h = dict(zip(fields[::2], fields[1::2]))
        if "w" not in h or "c" not in h:
            continue
        value = row[0].split("=", 1)[1].split("}", 1)[0] if "=" in row[0] else row[0]
        key = (2, value, int(h["w"]))
        stored, seen = int(h["c"]), counted.get(key, 0) - allowance.get(key, 0)
        ok = seen <= stored <= limit
        mismatches += 0 if ok else 1
        lines.append(f"`{value}` counted {stored}, answers seen {seen}"
                     + ("" if ok else " (MISMATCH)"))
    return lines, mismatches


# --- the section ----------------------------------------------------------------

def metric(work, replica, name):
    path = os.path.join(work, f"rk{replica}.metrics")
    if not os.path.exists(path):
        return "-"
    with open(path) as f:
        return sum(int(float(line.rsplit(" ", 1)[1])) for line in f
                   if line.startswith(name + " ") or line.startswith(name + "{"))


def generator_errors(work):
    """The first distinct error texts ratekeeper-soak saw (its summary line)."""
    path = os.path.join(work, "gen.out")
    lines = open(path).read().splitlines() if os.path.exists(path) else []
    errors = json.loads(lines[-1]).get("errors", []) if lines else []
    if not errors:
        return ["The generator saw no errors."]
    return ["The first distinct errors the generator saw:", ""] + [f"- `{e}`" for e in errors]


def section(work, command, seconds, limit, deadline_ms):
    events = events_of(work)
    timeline = read_jsonl(os.path.join(work, "timeline.jsonl"))
    totals = sum_rows(timeline)
    memory, growths = memory_table(work, events, seconds)
    counted, allowance, by_failure_mode, unattributed = count_admissions(
        work, events, deadline_ms)
    audit, overs = audit_table(counted, allowance, limit)
    compared, mismatches = store_comparison(work, counted, allowance, limit)
    replicas = read_tsv(os.path.join(work, "replicas.tsv"))
    panics = sum(int(r[2]) for r in replicas)
    dead = [r[0] for r in replicas if r[1] != "1"]
    fence = events.get("promote", [(0, "-")])[0][1]
    loads = "; ".join(
        f"replica {r[0]}: {metric(work, r[0], 'ratekeeper_config_load_success')} / "
        f"{metric(work, r[0], 'ratekeeper_config_load_error')}" for r in replicas)
    store_check = ("match" if not mismatches else f"{mismatches} mismatched") \
        if compared else "no audit counters left"
    out = [
        BEGIN,
        "## Soak run",
        "",
        f"`{command}` ({time.strftime('%Y-%m-%d', time.gmtime())}, {os.cpu_count()} cores; "
        "bench/soak.sh, written by bench/soak_report.py). Two release ratekeeper replicas "
        "(`--redis-type single`) behind one address (bench/forwarder.py) in front of Redis A, "
        "B its replica. ratekeeper-soak sends ShouldRateLimit on distinct values, on one hot "
        f"value and on 4 audit values (limit {limit} a minute), to either replica at random, "
        "and churns leases (acquire, heartbeats, release). The limits are rewritten every "
        f"10 s ({len(events.get('reload', []))} times); at 50% of the run Redis A is "
        "SIGKILLed and restarted empty; at 70% B is promoted, A demoted and the address "
        "moved to B.",
        "",
        "| target | result |",
        "|---|---|",
        "| resident memory growth after warm-up < 5% | "
        + (", ".join(f"{100 * g:+.1f}%" for g in growths) or "no samples") + " |",
        f"| panics: 0 | {panics}"
        + (f" (replica {', '.join(dead)} not running at the end)" if dead else "") + " |",
        f"| answers later than their deadline ({deadline_ms} ms) | {totals['late']} of "
        f"{answered(totals)} ShouldRateLimit calls, {totals['lease_late']} lease calls |",
        f"| over-admissions (audit values, exact counts): 0 | {overs} |",
        f"| Redis's audit counters vs the answers seen, after the run | {store_check} |",
        "",
        "Calls by phase (a call counts in the second it was sent):",
        "",
        *phase_table(timeline, events, deadline_ms),
        "",
        series(timeline, events),
        "",
        *recoveries(timeline, events),
        "",
        "Resident memory (VmRSS, sampled every 5 s):",
        "",
        *memory,
        "",
        "Over-admission (defined in bench/soak_report.py): OK answers on audit values "
        "decided by Redis, per value, one-minute window and store lineage (a store that "
        f"restarts empty may admit the limit again), against the limit ({limit}).",
        "",
        *audit,
        "",
        f"Admitted by the failure mode while Redis was unreachable (`open`, counted apart): "
        f"{by_failure_mode}; admissions without a window: {unattributed}; replicas that "
        f"acknowledged the failover fence: {fence or '-'}. After the run, on the final "
        f"primary: {'; '.join(compared) or 'no audit counters'}. Config loads "
        f"(success / error counters, the first load included): {loads}.",
        "",
        *generator_errors(work),
        END,
    ]
    return "\n".join(out) + "\n"


def write_section(path, text):
    old = open(path).read() if os.path.exists(path) else ""
    if BEGIN in old and END in old:
        head, rest = old.split(BEGIN, 1)
        new = head + text.rstrip("\n") + rest.split(END, 1)[1]
    else:
        new = old.rstrip("\n") + ("\n\n" if old else "") + text
    with open(path, "w") as f:
        f.write(new)


def main():
    if len(sys.argv) != 7:
        sys.exit(__doc__)
    work, out, command = sys.argv[1:4]
    seconds, limit, deadline_ms = float(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    text = section(work, command, seconds, limit, deadline_ms)
    sys.stdout.write(text)
    if out != "-":
        write_section(out, text)


if __name__ == "__main__":
    main()
