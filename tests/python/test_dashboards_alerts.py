"""The chart's Grafana dashboard and PrometheusRule (helm/ratekeeper):
every query is PromQL that parses, and every metric it reads is one ratekeeper
really exports, with the labels the query groups by.

What ratekeeper exports is scraped from running servers after traffic that
makes every lazily registered series appear: decisions within and over the
limit (and from the over-limit cache), a shadow-mode rule, an unknown domain,
leases acquired, held, released, lost and expired, a refused limits reload, and store
failures answered in each failure mode (a Redis that is not there).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import grpc
import promql_parser
import pytest
import yaml

from conftest import run_server
from rls_client import CHANNEL_OPTIONS
from test_helm_chart import NAMESPACE, find, one, render, validate_objects

FAILURE_MODES = ("open", "closed", "unavailable", "local")
# Labels Prometheus adds to every scraped series (the ServiceMonitor's target).
TARGET_LABELS = {"namespace", "job", "pod", "instance", "service", "container", "endpoint"}

LIMITS = """\
domain: dash
descriptors:
  - key: user
    rate_limit: {unit: hour, requests_per_unit: 2}
  - key: trial
    shadow_mode: true
    rate_limit: {unit: hour, requests_per_unit: 1}
---
domain: leases
concurrency:
  - key: user
    max_connections: 2
    lease_ttl: 30s
"""


def failing_store_limits() -> str:
    """A domain per failure mode, all on the one rule."""
    return "---\n".join(
        f"domain: fail-{mode}\nfailure_mode: {mode}\n"
        "descriptors:\n  - key: user\n    rate_limit: {unit: hour, requests_per_unit: 100}\n"
        for mode in FAILURE_MODES)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(server) -> str:
    with urllib.request.urlopen(server.metrics_url, timeout=5) as reply:
        return reply.read().decode()


def samples(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names it carries, from Prometheus text."""
    found: dict[str, set[str]] = {}
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ", line)
        if m:
            labels = set(re.findall(r"([a-zA-Z_][a-zA-Z0-9_]*)=\"", m[2] or ""))
            found.setdefault(m[1], set()).update(labels)
    return found


def wait_for(server, name: str, timeout: float = 10) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = scrape(server)
        if name in samples(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def drive_memory_server(server, rk, limits: Path) -> str:
    """Decisions, leases and reloads on the in-memory store; returns /metrics."""
    with rk.RateLimitClient(server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as client:
        user = [{"user": f"u-{uuid.uuid4().hex[:8]}"}]
        answers = [client.should_rate_limit("dash", user).allowed for _ in range(4)]
        # The third and fourth are over the limit, the fourth from the cache.
        assert answers == [True, True, False, False], server.log()
        for _ in range(2):
            assert client.should_rate_limit("dash", [{"trial": "t"}]).allowed  # shadow: never refused
        client.should_rate_limit("no-such-domain", user)

        lease = client.acquire_connection("leases", [{"user": "a"}], holder="pytest")
        assert lease.granted, lease
        client.release([lease.lease_id])
        assert client.heartbeat([lease.lease_id]).lost == (lease.lease_id,)
        # A lease left to expire is dropped (and counted) by the next acquire.
        assert client.acquire_connection("leases", [{"user": "c"}], lease_ttl=1).granted
        time.sleep(1.2)
        assert client.acquire_connection("leases", [{"user": "c"}]).granted
        with client.hold("leases", [{"user": "b"}]) as held:
            assert held.granted, held
            wait_for(server, "ratekeeper_concurrency_held_leases")

    # A refused change: the reload error counter appears.
    (limits / "broken.yaml").write_text("domain: broken\nnot_a_key: 1\n")
    return wait_for(server, "ratekeeper_config_load_error")


def drive_failing_store_server(server, rk) -> str:
    """Decisions while Redis is unreachable, one domain per failure mode."""
    with rk.RateLimitClient(server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as client:
        for mode in FAILURE_MODES:
            try:
                client.should_rate_limit(f"fail-{mode}", [{"user": "x"}])
            except grpc.RpcError as e:
                assert mode == "unavailable" and e.code() == grpc.StatusCode.UNAVAILABLE, e
    return wait_for(server, "ratekeeper_store_up")


@pytest.fixture(scope="module")
def exported(rk, tmp_path_factory) -> dict[str, set[str]]:
    """Every sample name ratekeeper exports after the traffic above -> its labels."""
    limits = tmp_path_factory.mktemp("dash-limits")
    (limits / "dash.yaml").write_text(LIMITS)
    log = tmp_path_factory.mktemp("dash-server") / "ratekeeper.log"
    with run_server(limits, log, "--reload-interval-ms", "100") as server:
        text = drive_memory_server(server, rk, limits)
    failing = tmp_path_factory.mktemp("failing-limits")
    (failing / "fail.yaml").write_text(failing_store_limits())
    log = tmp_path_factory.mktemp("failing-server") / "ratekeeper.log"
    redis_url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    with run_server(failing, log, "--redis-url", redis_url, "--redis-connect-timeout-ms", "200") as server:
        text += drive_failing_store_server(server, rk)
    found = samples(text)
    for name in ("ratekeeper_config_load_error", "ratekeeper_config_load_failing",
                 "ratekeeper_concurrency_leases_lost",
                 "ratekeeper_over_limit_cache_hits", "ratekeeper_store_error_fail_local",
                 "ratekeeper_store_call_duration_seconds_bucket"):
        assert name in found, f"the traffic did not make {name} appear:\n{text}"
    return found


# --- the queries ---------------------------------------------------------------

ALL_ON = {"serviceMonitor": {"enabled": True}, "dashboards": {"enabled": True}, "alerts": {"enabled": True}}


@pytest.fixture(scope="module")
def chart():
    import helm_python
    with helm_python.Chart.load(Path(__file__).resolve().parents[2] / "helm" / "ratekeeper") as c:
        yield c


def dashboard_of(objects) -> dict:
    [cm] = [o for o in find(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    return json.loads(cm["data"]["ratekeeper.json"])


def rules_of(objects) -> list[dict]:
    rule = one(objects, "PrometheusRule")
    return [r for group in rule["spec"]["groups"] for r in group["rules"]]


def dashboard_queries(dashboard) -> list[str]:
    """Every panel target's expression and every query variable's metric
    selector, Grafana's variables replaced by values PromQL accepts."""
    queries = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            m = re.fullmatch(r"label_values\((.+), *([a-z_]+)\)", var["query"]["query"])
            assert m, var
            queries.append(m[1])
    return [re.sub(r"\$[a-z_]+", "x", q.replace("$__rate_interval", "5m")) for q in queries]


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, labels grouped by above it) of every selector in expr."""
    ast = promql_parser.parse(expr)  # raises on a syntax error
    found: list[tuple[str, set[str]]] = []

    def visit(node, by: set[str]):
        if isinstance(node, promql_parser.VectorSelector):
            found.append((node.name, by))
            return
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None \
                and node.modifier.type == promql_parser.AggModifierType.By:
            by = by | set(node.modifier.labels)
        for child in ("expr", "lhs", "rhs", "args", "param", "vector_selector"):
            value = getattr(node, child, None)
            for c in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(c, promql_parser.Expr):
                    visit(c, by)

    visit(ast, set())
    names = []
    promql_parser.walk(ast, lambda n: names.append(n.name) if isinstance(n, promql_parser.VectorSelector) else None)
    assert sorted(names) == sorted(n for n, _ in found), (expr, names, found)  # nothing missed
    return found


def test_every_metric_the_dashboard_and_alerts_query_is_exported(chart, exported):
    objects = render(chart, ALL_ON)
    queries = dashboard_queries(dashboard_of(objects)) + [r["expr"] for r in rules_of(objects)]
    assert len(queries) >= 20
    used = set()
    for expr in queries:
        for name, grouped_by in selectors(expr):
            assert name and name.startswith("ratekeeper_"), f"{expr}: selects {name!r}"
            assert name in exported, f"{expr}: ratekeeper does not export {name}"
            missing = grouped_by - exported[name] - TARGET_LABELS
            assert not missing, f"{expr}: {name} has no label {missing} (it has {exported[name]})"
            used.add(name)
    # The dashboard covers what issue #24 asks for.
    for name in ("ratekeeper_rate_limit_over_limit", "ratekeeper_store_error_fail_open",
                 "ratekeeper_store_errors", "ratekeeper_request_duration_seconds_bucket",
                 "ratekeeper_over_limit_cache_hits", "ratekeeper_concurrency_active",
                 "ratekeeper_concurrency_leases_lost", "ratekeeper_config_load_error",
                 "ratekeeper_store_up", "ratekeeper_store_call_duration_seconds_bucket"):
        assert name in used, name


def test_a_misspelt_metric_would_be_caught(exported):
    """The check above can fail: a name off by one letter is not exported."""
    [(name, _)] = selectors("sum(rate(ratekeeper_rate_limit_overlimit[5m]))")
    assert name not in exported
    with pytest.raises(ValueError):
        selectors("sum(rate(ratekeeper_rate_limit_over_limit[5m])")


# --- the rendered objects ------------------------------------------------------


def test_off_by_default(chart):
    objects = render(chart)
    assert not find(objects, "PrometheusRule")
    assert not [o for o in find(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]


def test_dashboard_configmap_for_the_grafana_sidecar(chart):
    objects = render(chart, {"dashboards": {"enabled": True}})
    validate_objects(objects)
    [cm] = [o for o in find(objects, "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    # kube-prometheus-stack's sidecar default: label grafana_dashboard="1".
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == NAMESPACE
    dashboard = dashboard_of(objects)
    assert dashboard["uid"] == "ratekeeper" and dashboard["panels"]
    # The dashboard file is the one the chart ships, byte for byte.
    shipped = (Path(__file__).resolve().parents[2] / "helm" / "ratekeeper" / "dashboards" / "ratekeeper.json")
    assert cm["data"]["ratekeeper.json"] == shipped.read_text()
    for panel in dashboard["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"] and panel["title"] and panel["description"], panel["title"]
    # No two panels overlap on the grid.
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        mine = {(g["x"] + i, g["y"] + j) for i in range(g["w"]) for j in range(g["h"])}
        assert not cells & mine and all(x < 24 for x, _ in mine), panel["title"]
        cells |= mine

    # The sidecar's label, the namespace it searches, a folder annotation.
    values = {"dashboards": {"enabled": True, "label": "example.com/dashboard", "labelValue": "yes",
                             "namespace": "monitoring", "annotations": {"grafana_folder": "Rate limiting"}}}
    [cm] = [o for o in find(render(chart, values), "ConfigMap") if o["metadata"]["name"].endswith("-dashboard")]
    assert cm["metadata"]["labels"]["example.com/dashboard"] == "yes"
    assert "grafana_dashboard" not in cm["metadata"]["labels"]
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Rate limiting"}


RULE_KEYS = {"alert", "expr", "for", "labels", "annotations"}


def test_prometheus_rule_alerts_and_thresholds(chart):
    objects = render(chart, {"alerts": {"enabled": True, "labels": {"release": "kube-prometheus-stack"},
                                        "alertLabels": {"team": "edge"}}})
    validate_objects(objects)
    rule = one(objects, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    rules = {r["alert"]: r for r in rules_of(objects)}
    assert set(rules) == {"RatekeeperStoreDown", "RatekeeperConfigReloadFailing",
                          "RatekeeperOverLimitSurge", "RatekeeperDecisionLatencyHigh"}
    for name, r in rules.items():
        assert set(r) <= RULE_KEYS, (name, set(r) - RULE_KEYS)
        assert r["labels"]["team"] == "edge" and r["labels"]["severity"], name
        assert r["annotations"]["summary"] and r["annotations"]["description"], name
        # Only this release's series: the namespace and its ServiceMonitor's job.
        assert r["expr"].count('namespace="rate", job="rk-ratekeeper"') == len(selectors(r["expr"])), name
    assert rules["RatekeeperStoreDown"]["labels"]["severity"] == "critical"
    assert rules["RatekeeperStoreDown"]["for"] == "2m"
    assert re.search(r"\) > 0\.025$", rules["RatekeeperDecisionLatencyHigh"]["expr"])

    # Every threshold is a value.
    values = {"alerts": {"enabled": True,
                         "storeDown": {"for": "30s", "severity": "page"},
                         "configReloadFailing": {"window": "1h"},
                         "overLimitSurge": {"ratio": 0.9, "minHitsPerSecond": 250, "for": "1m"},
                         "decisionLatency": {"seconds": 0.1, "for": "3m"}}}
    rules = {r["alert"]: r for r in rules_of(render(chart, values))}
    assert (rules["RatekeeperStoreDown"]["for"], rules["RatekeeperStoreDown"]["labels"]["severity"]) == ("30s", "page")
    assert rules["RatekeeperConfigReloadFailing"]["expr"].count("1h") == 2
    surge = rules["RatekeeperOverLimitSurge"]
    assert ") > 0.9\n" in surge["expr"] and surge["expr"].endswith("> 250") and surge["for"] == "1m"
    latency = rules["RatekeeperDecisionLatencyHigh"]
    assert latency["expr"].endswith("> 0.1") and latency["for"] == "3m"
    assert "threshold 0.1 s" in latency["annotations"]["description"]


# --- the alerts fire when they should: Prometheus' own rule engine --------------
#
# promtool (`make promtool`, or $PROMTOOL) checks the rendered rules and runs
# them over synthetic series of the release's namespace and job.

SERIES = 'namespace="rate", job="rk-ratekeeper", pod="rk-0"'


def promtool() -> str:
    path = os.environ.get("PROMTOOL") or shutil.which("promtool")
    if not path or not Path(path).is_file():
        pytest.fail("promtool not found: run `make promtool` (it sets $PROMTOOL for `make test`)")
    return path


@pytest.fixture
def rules_file(chart, tmp_path) -> Path:
    """The rendered PrometheusRule's groups as a Prometheus rules file."""
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(one(render(chart, ALL_ON), "PrometheusRule")["spec"]))
    return path


def run_promtool(*args, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([promtool(), *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_promtool_accepts_the_rules(rules_file):
    out = run_promtool("check", "rules", str(rules_file), cwd=rules_file.parent)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "4 rules found" in out.stdout, out.stdout


def alert(name: str, eval_time: str, annotations: dict | None = None, **labels) -> dict:
    """An alert_rule_test: `name` firing with these labels and annotations at
    eval_time (none if no labels)."""
    expected = {"exp_labels": labels, "exp_annotations": annotations}
    return {"eval_time": eval_time, "alertname": name, "exp_alerts": [expected] if labels else []}


STORE_DOWN = {
    "summary": "ratekeeper rk-0 cannot reach its store",
    "description": "The store (Redis) of rate/rk-0 has not answered its health probe for 2m. "
                   "Decisions follow the failure mode (default unavailable: Envoy's failure_mode_deny decides)."}
RELOAD_REFUSED = {
    "summary": "ratekeeper rk-0 refused a limits change",
    "description": "rate/rk-0 refused a change of its limits (directory or xDS snapshot); the previous limits "
                   "stay in force, and a restart would not start with the refused ones. "
                   "Its log names the file, line and reason; `ratekeeper validate --config-dir DIR` checks a directory."}
SURGE = {
    "summary": "Many hits of rule a in domain d are over the limit",
    "description": "80% of the hits of rule a in domain d (rate) are refused: a client flooding, or a limit set too low."}
SLOW = {
    "summary": "ratekeeper decisions are slow",
    "description": "The 99th percentile of ratekeeper's decision latency in rate is 49.5ms (threshold 0.025 s): "
                   "Envoy may time out and apply its own failure mode. Check the store's latency and the replicas' CPU."}


def test_alerts_fire_on_their_conditions_and_not_before(rules_file):
    tests = [
        {   # Down from minute 2: pending for the 2m of `for`, then firing.
            "interval": "1m",
            "input_series": [{"series": f"ratekeeper_store_up{{{SERIES}}}", "values": "1 1 0x10"}]
                            + [{"series": f'ratekeeper_store_up{{{SERIES.replace("rk-0", "rk-1")}}}',
                                "values": "1x12"}],
            "alert_rule_test": [
                alert("RatekeeperStoreDown", "1m"),
                alert("RatekeeperStoreDown", "3m"),
                alert("RatekeeperStoreDown", "5m", STORE_DOWN, severity="critical", namespace="rate", pod="rk-0"),
            ],
        },
        {   # The error counter appears at minute 5 with its first refusal
            # (lazily registered: increase() alone would miss it), a second
            # refusal at minute 40. The first stays refused until minute 25
            # (the failing gauge), past the 15m window.
            "interval": "1m",
            "input_series": [{"series": f"ratekeeper_config_load_error{{{SERIES}}}",
                              "values": "_x4 1x34 2x20"},
                             {"series": f"ratekeeper_config_load_failing{{{SERIES}}}",
                              "values": "_x4 1x20 0x14 1x20"}],
            "alert_rule_test": [
                alert("RatekeeperConfigReloadFailing", "3m"),
                alert("RatekeeperConfigReloadFailing", "6m", RELOAD_REFUSED, severity="warning", namespace="rate", pod="rk-0"),
                alert("RatekeeperConfigReloadFailing", "18m", RELOAD_REFUSED, severity="warning", namespace="rate", pod="rk-0"),
                alert("RatekeeperConfigReloadFailing", "24m", RELOAD_REFUSED, severity="warning", namespace="rate", pod="rk-0"),
                alert("RatekeeperConfigReloadFailing", "30m"),
                alert("RatekeeperConfigReloadFailing", "45m", RELOAD_REFUSED, severity="warning", namespace="rate", pod="rk-0"),
            ],
        },
        {   # Rule a: 80% of 10 hits/s refused, for 20 minutes. Rule b: 90% of
            # 0.5 hits/s (below minHitsPerSecond). Rule c: 10% of 10 hits/s.
            # Rule d: 80% over its limit, all in shadow mode (admitted).
            "interval": "1m",
            "input_series": [
                {"series": f'ratekeeper_rate_limit_total_hits{{{SERIES}, domain="d", rule="{r}"}}',
                 "values": f"0+{total}x30"} for r, total in (("a", 600), ("b", 30), ("c", 600), ("d", 600))
            ] + [
                {"series": f'ratekeeper_rate_limit_over_limit{{{SERIES}, domain="d", rule="{r}"}}',
                 "values": f"0+{over}x30"} for r, over in (("a", 480), ("b", 27), ("c", 60), ("d", 480))
            ] + [
                {"series": f'ratekeeper_rate_limit_shadow_mode{{{SERIES}, domain="d", rule="d"}}',
                 "values": "0+480x30"},
            ],
            "alert_rule_test": [
                alert("RatekeeperOverLimitSurge", "8m"),
                alert("RatekeeperOverLimitSurge", "20m", SURGE, severity="warning", namespace="rate",
                      domain="d", rule="a"),
            ],
        },
        {   # Half the decisions take 25-50 ms: p99 above 25 ms. Another
            # namespace is not this release's.
            "interval": "1m",
            "input_series": [
                {"series": f'ratekeeper_request_duration_seconds_bucket{{{SERIES}, le="{le}"}}',
                 "values": f"0+{n}x30"} for le, n in (("0.01", 300), ("0.025", 300), ("0.05", 600), ("+Inf", 600))
            ] + [
                {"series": f'ratekeeper_request_duration_seconds_bucket{{namespace="other", job="rk-ratekeeper", '
                           f'pod="x", le="{le}"}}', "values": "0+600x30"} for le in ("0.05", "+Inf")
            ],
            "alert_rule_test": [
                alert("RatekeeperDecisionLatencyHigh", "5m"),
                alert("RatekeeperDecisionLatencyHigh", "20m", SLOW, severity="warning", namespace="rate"),
            ],
        },
    ]
    (rules_file.parent / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": tests}))
    out = run_promtool("test", "rules", "tests.yaml", cwd=rules_file.parent)
    assert out.returncode == 0, out.stdout + out.stderr


def test_promtool_test_can_fail(rules_file):
    """The harness above notices an alert that does not fire."""
    tests = [{"interval": "1m",
              "input_series": [{"series": f"ratekeeper_store_up{{{SERIES}}}", "values": "1x10"}],
              "alert_rule_test": [alert("RatekeeperStoreDown", "5m", STORE_DOWN, severity="critical",
                                        namespace="rate", pod="rk-0")]}]
    (rules_file.parent / "tests.yaml").write_text(yaml.safe_dump(
        {"rule_files": [rules_file.name], "evaluation_interval": "1m", "tests": tests}))
    out = run_promtool("test", "rules", "tests.yaml", cwd=rules_file.parent)
    assert out.returncode != 0 and "RatekeeperStoreDown" in out.stdout + out.stderr, out
