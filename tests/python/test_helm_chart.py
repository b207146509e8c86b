"""The Helm chart (helm/ratekeeper): lint, render and validate, offline.

Helm's own engine renders the chart (PyPI helm-python-sdk: Helm's Go SDK
through a C ABI, no helm binary, no cluster), with the default values and with
each helm/ratekeeper/ci/*.yaml. Every rendered object is checked against the
Kubernetes 1.30 schemas in strict mode (PyPI kubernetes-validate: unknown
fields fail); CRD kinds (ServiceMonitor) have no schema there, so only their
apiVersion/kind and the fields ratekeeper relies on are checked (the
PrometheusRule and the dashboard: test_dashboards_alerts.py). Each
rendered pod is then started for real: the ratekeeper binary runs with the
container's environment as Kubernetes would build it (Secret values, $(VAR)
expansion, Secret volumes laid out in a temporary directory with throwaway
certificates) and answers the rendered probes.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import socket
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import helm_python
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import LISTENING, REPO, ratekeeper_bin, run_announcing, run_server

# The readiness line with the chart's LOG_FORMAT=json: a JSON log line
# whose fields are the addresses.
LISTENING_JSON = re.compile(r'^\{"@message":"listening",.*\}$')
from rls_client import RlsClient

CHART = REPO / "helm" / "ratekeeper"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
K8S_VERSION = "1.30"
RELEASE, NAMESPACE = "rk", "rate"
FULLNAME = f"{RELEASE}-ratekeeper"
LIMITS_DIR = "/etc/ratekeeper/limits"
# Kinds served by CRDs, not by Kubernetes itself: apiVersion -> kinds.
CRD_KINDS = {"monitoring.coreos.com/v1": {"ServiceMonitor", "PrometheusRule"}}
# Env vars the chart may set that the binary does not read itself.
CHART_ONLY_ENV = {"REDIS_PASSWORD"}  # expanded into REDIS_AUTH by Kubernetes (with a username)
# Env vars holding paths of files from mounted Secrets.
TLS_FILE_ENV = {"GRPC_TLS_CERT", "GRPC_TLS_KEY", "GRPC_TLS_CLIENT_CA",
                "REDIS_TLS_CACERT", "REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY"}
NEW_CI_FILES = {"redis-cluster.yaml", "redis-sentinel.yaml", "redis-tls.yaml", "grpc-tls.yaml",
                "failure-mode-closed.yaml", "dashboards-alerts.yaml"}


def ci_values(name: str) -> dict:
    return yaml.safe_load((CHART / "ci" / name).read_text())


@pytest.fixture(scope="module")
def chart():
    with helm_python.Chart.load(CHART) as c:
        yield c


def render(chart, values=None, release=RELEASE) -> list[dict]:
    """The rendered objects (NOTES.txt and empty templates left out)."""
    out = chart.render(values, name=release, namespace=NAMESPACE)
    objects = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        objects.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return objects


def notes(chart, values=None) -> str:
    out = chart.render(values, name=RELEASE, namespace=NAMESPACE)
    return next(text for path, text in out.items() if path.endswith("NOTES.txt"))


def find(objects, kind, name=None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects, kind, name=None) -> dict:
    found = find(objects, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[o['metadata']['name'] for o in found]}"
    return found[0]


def server_deployment(objects) -> dict:
    return one(objects, "Deployment", FULLNAME)


def container(deploy) -> dict:
    containers = deploy["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["ratekeeper"]
    return containers[0]


def env_of(c) -> dict:
    return {e["name"]: e for e in c.get("env", [])}


def values_of(c) -> dict:
    """name -> literal value (env vars from a Secret left out)."""
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def volume(deploy, name) -> dict:
    [v] = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == name]
    return v


def mount(c, name) -> dict:
    [m] = [m for m in c["volumeMounts"] if m["name"] == name]
    return m


def assert_tls_files_mounted(deploy):
    """Every TLS file the env names is an item of a Secret volume mounted read-only, whole."""
    c = container(deploy)
    env = values_of(c)
    for name in TLS_FILE_ENV & env.keys():
        path = Path(env[name])
        [m] = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
        assert m["readOnly"] is True and "subPath" not in m, m
        secret = volume(deploy, m["name"])["secret"]
        assert path.name in {i["path"] for i in secret["items"]}, (name, secret)
    # ...and no Secret volume is mounted that no env var uses.
    used = {str(Path(env[n]).parent) for n in TLS_FILE_ENV & env.keys()}
    for v in deploy["spec"]["template"]["spec"]["volumes"]:
        if "secret" in v:
            assert mount(c, v["name"])["mountPath"] in used, v


def validate_objects(objects):
    """Every object against Kubernetes' schemas (strict), CRD kinds by apiVersion/kind."""
    assert objects
    for obj in objects:
        where = f"{obj.get('kind')}/{obj.get('metadata', {}).get('name')}"
        assert obj["metadata"]["namespace"] == NAMESPACE, where
        # Service names are DNS labels (63); the others DNS subdomains (253).
        assert len(obj["metadata"]["name"]) <= (63 if obj["kind"] == "Service" else 253), where
        if obj["apiVersion"] in CRD_KINDS:
            assert obj["kind"] in CRD_KINDS[obj["apiVersion"]], where
            continue
        try:
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{where} is not a valid Kubernetes {K8S_VERSION} object at {list(e.path)}: {e.message}")


# --- lint and render every values file ---------------------------------------


def test_ci_values_files_exist():
    names = {p.name for p in CI_VALUES}
    assert {"redis-embedded.yaml", "existing-secret.yaml", "hpa-pdb-netpol-servicemonitor.yaml",
            "existing-configmap.yaml", *NEW_CI_FILES} <= names


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_lint(values_file):
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    report = helm_python.lint(CHART, values, strict=True, namespace=NAMESPACE, kube_version=f"v{K8S_VERSION}.0")
    problems = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
    assert report["total_charts_linted"] == 1
    assert not problems and not report["errors"], report


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_renders_valid_kubernetes_objects(chart, values_file):
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    chart.validate_schema(values)
    objects = render(chart, values)
    validate_objects(objects)
    deploy = server_deployment(objects)
    # The Service and PDB/HPA/NetworkPolicy/ServiceMonitor select the server pods.
    pod_labels = deploy["spec"]["template"]["metadata"]["labels"]
    assert deploy["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    for svc in find(objects, "Service"):
        if svc["metadata"]["name"].endswith("-redis"):
            continue
        assert svc["spec"]["selector"].items() <= pod_labels.items(), svc["metadata"]["name"]
    assert_tls_files_mounted(deploy)


def test_strict_validation_catches_a_bad_field(chart):
    """The validator really is strict: an unknown field in a rendered object fails."""
    deploy = copy.deepcopy(server_deployment(render(chart)))
    kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)
    container(deploy)["livenessProbe"]["grpc"]["servcie"] = ""
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deploy, K8S_VERSION, strict=True)


def test_long_release_name_keeps_valid_names(chart):
    values = {"redis": {"embedded": {"enabled": True}}, "networkPolicy": {"enabled": True},
              "commonLabels": {"team": "edge"}}
    objects = render(chart, values, release="r" * 53)
    validate_objects(objects)
    services = [o["metadata"]["name"] for o in find(objects, "Service")]
    assert len(services) == len(set(services)) == 3
    assert all(o["metadata"]["labels"]["team"] == "edge" for o in objects)


# --- the defaults --------------------------------------------------------------


def test_defaults_probes_security_and_ports(chart):
    objects = render(chart)
    deploy = server_deployment(objects)
    pod = deploy["spec"]["template"]["spec"]
    c = container(deploy)

    # Liveness asks for the process ("liveness" is always SERVING); readiness
    # for the service ("" turns SERVING once the store has answered).
    assert c["livenessProbe"]["grpc"] == {"port": 8081, "service": "liveness"}
    assert c["readinessProbe"]["grpc"] == {"port": 8081, "service": ""}
    for probe in ("livenessProbe", "readinessProbe"):
        assert not {"httpGet", "tcpSocket", "exec"} & c[probe].keys()
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 8081, "metrics": 9090, "http": 8080}

    sc = c["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"] and "add" not in sc["capabilities"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["automountServiceAccountToken"] is False

    assert deploy["spec"]["replicas"] == 1
    assert deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    assert deploy["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    terms = pod["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"]
    assert terms[0]["podAffinityTerm"]["topologyKey"] == "kubernetes.io/hostname"
    assert terms[0]["podAffinityTerm"]["labelSelector"]["matchLabels"].items() <= \
        deploy["spec"]["template"]["metadata"]["labels"].items()
    assert "requiredDuringSchedulingIgnoredDuringExecution" not in pod["affinity"]["podAntiAffinity"]
    assert c["resources"]["requests"] and c["resources"]["limits"]

    svc = one(objects, "Service", FULLNAME)
    assert {p["name"]: (p["port"], p["targetPort"]) for p in svc["spec"]["ports"]} == {
        "grpc": (8081, "grpc"), "metrics": (9090, "metrics")}
    headless = one(objects, "Service", f"{FULLNAME}-headless")
    assert headless["spec"]["clusterIP"] == "None"
    assert [p["port"] for p in headless["spec"]["ports"]] == [8081]

    # No optional objects by default.
    for kind in ("HorizontalPodAutoscaler", "PodDisruptionBudget", "ServiceMonitor", "NetworkPolicy"):
        assert not find(objects, kind), kind
    assert [d["metadata"]["name"] for d in find(objects, "Deployment")] == [FULLNAME]


def test_defaults_env_matches_the_binary(chart):
    """Every env var the chart sets is one the binary reads (from its --help)."""
    help_text = subprocess.run([str(ratekeeper_bin()), "--help"], capture_output=True, text=True,
                               check=True, timeout=30).stdout
    # "[env: NAME=value]", or "[env: NAME]" for hidden values (REDIS_AUTH).
    known = set(re.findall(r"\[env: ([A-Z0-9_]+)[=\]]", help_text))
    assert {"CONFIG_DIR", "REDIS_URL", "LOG_FORMAT"} <= known, help_text
    for values in [None, *(yaml.safe_load(p.read_text()) for p in CI_VALUES)]:
        env = env_of(container(server_deployment(render(chart, values))))
        assert set(env) - CHART_ONLY_ENV <= known, set(env) - CHART_ONLY_ENV - known
    env = values_of(container(server_deployment(render(chart))))
    assert env["CONFIG_DIR"] == LIMITS_DIR
    assert env["GRPC_ADDR"].endswith(":8081")
    assert env["METRICS_ADDR"].endswith(":9090")
    assert env["LOG_FORMAT"] in ("text", "json")
    assert not {k for k in env if k.startswith("REDIS_")}  # no Redis configured: the in-memory store
    assert "single replica" in notes(chart)
    # The new settings' defaults are the binary's own.
    assert env["FAILURE_MODE"] == "unavailable"
    assert env["EXPECTED_REPLICAS"] == "1"
    assert env["LIMIT_RESPONSE_HEADERS_ENABLED"] == "false"
    assert env["MAX_DETAILED_METRIC_SERIES"] == "10000"
    assert "GRPC_MAX_CONNECTION_AGE" not in env and not TLS_FILE_ENV & env.keys()
    assert "SERVING_THREADS" not in env  # the binary's default: one per core


def test_defaults_limits_configmap_is_mounted_whole_and_loads(chart, tmp_path):
    objects = render(chart)
    deploy = server_deployment(objects)
    c = container(deploy)
    [mount] = [m for m in c["volumeMounts"] if m["mountPath"] == LIMITS_DIR]
    assert "subPath" not in mount, "a subPath mount never sees ConfigMap updates (no hot reload)"
    [volume] = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    cm = one(objects, "ConfigMap", volume["configMap"]["name"])
    assert cm["data"] and all(re.fullmatch(r"[-._a-zA-Z0-9]+\.ya?ml", k) for k in cm["data"])

    # The rendered files are limits files the binary accepts.
    for name, content in cm["data"].items():
        (tmp_path / name).write_text(content)
    domains = [yaml.safe_load(content)["domain"] for content in cm["data"].values()]
    with run_server(tmp_path, tmp_path / "ratekeeper.log") as server, RlsClient(server.grpc_addr) as rls:
        resp = rls.should_rate_limit(domains[0], [{"remote_address": "192.0.2.10"}])
        assert resp.statuses[0].current_limit is not None, server.log()


# --- config checksum and hot reload -------------------------------------------


def checksum(objects):
    annotations = server_deployment(objects)["spec"]["template"]["metadata"].get("annotations") or {}
    return annotations.get("checksum/config")


def test_checksum_annotation_only_without_hot_reload(chart):
    assert checksum(render(chart)) is None
    assert checksum(render(chart, {"hotReload": True, "podAnnotations": {"a": "b"}})) is None
    on = checksum(render(chart, {"hotReload": False}))
    assert on and re.fullmatch(r"[0-9a-f]{64}", on)
    # It follows the limits: a change rolls the pods.
    changed = checksum(render(chart, {"hotReload": False, "limits": {"extra.yaml": "domain: extra\n"}}))
    assert changed and changed != on
    assert checksum(render(chart, {"hotReload": False})) == on
    assert checksum(render(chart, ci_values("hpa-pdb-netpol-servicemonitor.yaml")))


# --- ci/*.yaml cases -------------------------------------------------------------


def test_existing_secret_password_via_redis_auth(chart):
    """With an ACL user: REDIS_AUTH is user:$(REDIS_PASSWORD), the password from the Secret."""
    values = ci_values("existing-secret.yaml")
    objects = render(chart, values)
    c = container(server_deployment(objects))
    names = [e["name"] for e in c["env"]]
    env = env_of(c)
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": values["redis"]["auth"]["existingSecret"],
                   "key": values["redis"]["auth"]["existingSecretPasswordKey"]}
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_AUTH")
    assert env["REDIS_AUTH"]["value"] == "ratekeeper:$(REDIS_PASSWORD)"
    # The URL carries no credentials any more.
    assert env["REDIS_URL"]["value"] == "redis://redis-master.data.svc.cluster.local:6379/2"
    assert env["REDIS_TYPE"]["value"] == "single"
    assert env["REDIS_POOL_SIZE"]["value"] == "8"
    assert env["REDIS_TIMEOUT_MS"]["value"] == "50"
    assert env["REDIS_CONNECT_TIMEOUT_MS"]["value"] == "2000"
    assert env["CACHE_KEY_PREFIX"]["value"] == "prod:rk:"
    assert not find(objects, "Secret"), "the chart must not create or copy the Secret"
    assert server_deployment(objects)["spec"]["replicas"] == 3
    assert env["EXPECTED_REPLICAS"]["value"] == "3"  # replicaCount

    # Without a username the Secret's value is REDIS_AUTH itself.
    values["redis"]["auth"]["username"] = ""
    env = env_of(container(server_deployment(render(chart, values))))
    assert env["REDIS_AUTH"]["valueFrom"]["secretKeyRef"] == ref
    assert "REDIS_PASSWORD" not in env and "value" not in env["REDIS_AUTH"]


def test_go_durations_unix_sockets_and_probe_thresholds_are_taken(chart):
    """What the binary takes, the schema takes: Go durations for the
    connection age and its grace (0: never), a Unix socket as the Redis URL,
    a readiness probe's successThreshold."""
    for age in ["0", "0s", "1h30m", "1.5h", "500ms"]:
        values = {"maxConnectionAge": age, "maxConnectionAgeGrace": age}
        env = values_of(container(server_deployment(render(chart, values))))
        assert env["GRPC_MAX_CONNECTION_AGE"] == age
        assert env["GRPC_MAX_CONNECTION_AGE_GRACE"] == age
    values = {"redis": {"mode": "standalone", "url": "/var/run/redis/redis.sock"}}
    env = values_of(container(server_deployment(render(chart, values))))
    assert env["REDIS_URL"] == "/var/run/redis/redis.sock"
    probe = container(server_deployment(render(chart, {"readinessProbe": {"successThreshold": 2}})))
    assert probe["readinessProbe"]["successThreshold"] == 2


def test_redis_embedded(chart):
    objects = render(chart, ci_values("redis-embedded.yaml"))
    redis_name = f"{FULLNAME}-redis"
    redis = one(objects, "Deployment", redis_name)
    redis_svc = one(objects, "Service", redis_name)
    env = env_of(container(server_deployment(objects)))
    assert env["REDIS_URL"]["value"] == f"redis://{redis_name}:6379"
    assert env["REDIS_TYPE"]["value"] == "single"
    assert "REDIS_PASSWORD" not in env and "REDIS_AUTH" not in env and "REDIS_TLS" not in env
    assert redis["spec"]["replicas"] == 1
    redis_pod_labels = redis["spec"]["template"]["metadata"]["labels"]
    assert redis_svc["spec"]["selector"].items() <= redis_pod_labels.items()
    assert redis_svc["spec"]["ports"][0]["port"] == 6379
    # The server's Service must not select the Redis pod, nor Redis' the server pods.
    server_labels = server_deployment(objects)["spec"]["template"]["metadata"]["labels"]
    assert not one(objects, "Service", FULLNAME)["spec"]["selector"].items() <= redis_pod_labels.items()
    assert not redis_svc["spec"]["selector"].items() <= server_labels.items()
    assert redis["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    # With networkPolicy on, only the server pods reach Redis.
    redis_np = one(objects, "NetworkPolicy", redis_name)
    [rule] = redis_np["spec"]["ingress"]
    assert rule["from"][0]["podSelector"]["matchLabels"].items() <= server_labels.items()
    assert "WARNING" in notes(chart, ci_values("redis-embedded.yaml"))


def test_hpa_pdb_netpol_servicemonitor(chart):
    values = ci_values("hpa-pdb-netpol-servicemonitor.yaml")
    objects = render(chart, values)
    deploy = server_deployment(objects)
    assert "replicas" not in deploy["spec"], "the HPA owns the replica count"

    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": FULLNAME}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 12)
    targets = {m["resource"]["name"]: m["resource"]["target"]["averageUtilization"] for m in hpa["spec"]["metrics"]}
    assert targets == {"cpu": 60, "memory": 80}

    pdb = one(objects, "PodDisruptionBudget")
    assert pdb["apiVersion"] == "policy/v1"
    assert pdb["spec"]["minAvailable"] == 2 and "maxUnavailable" not in pdb["spec"]

    sm = one(objects, "ServiceMonitor")
    assert (sm["apiVersion"], sm["kind"]) == ("monitoring.coreos.com/v1", "ServiceMonitor")
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    [endpoint] = sm["spec"]["endpoints"]
    assert (endpoint["port"], endpoint["path"], endpoint["interval"]) == ("metrics", "/metrics", "15s")
    svc = one(objects, "Service", FULLNAME)
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert "metrics" in {p["name"] for p in svc["spec"]["ports"]}
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}

    np = one(objects, "NetworkPolicy", FULLNAME)
    assert np["spec"]["podSelector"]["matchLabels"].items() <= \
        deploy["spec"]["template"]["metadata"]["labels"].items()
    by_port = {rule["ports"][0]["port"]: rule for rule in np["spec"]["ingress"]}
    assert by_port[8081]["from"] == values["networkPolicy"]["grpcFrom"]
    assert by_port[9090]["from"] == values["networkPolicy"]["metricsFrom"]

    annotations = deploy["spec"]["template"]["metadata"]["annotations"]
    assert annotations["example.com/team"] == "edge" and "checksum/config" in annotations
    # failureMode local with the HPA: each pod's share is limit / maxReplicas.
    assert values_of(container(deploy))["EXPECTED_REPLICAS"] == "12"


def test_existing_configmap(chart):
    values = ci_values("existing-configmap.yaml")
    objects = render(chart, values)
    assert not find(objects, "ConfigMap"), "no ConfigMap of the chart's own"
    deploy = server_deployment(objects)
    [volume] = [v for v in deploy["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    assert volume["configMap"]["name"] == "my-ratekeeper-limits"
    assert checksum(objects) is None
    assert checksum(render(chart, {**values, "hotReload": False})) is None  # content unknown to the chart
    assert "affinity" not in deploy["spec"]["template"]["spec"]  # podAntiAffinity: none
    assert deploy["spec"]["template"]["spec"]["serviceAccountName"] == "default"
    assert not find(objects, "ServiceAccount")


def test_redis_cluster(chart):
    values = ci_values("redis-cluster.yaml")
    objects = render(chart, values)
    deploy = server_deployment(objects)
    c = container(deploy)
    env = env_of(c)
    assert env["REDIS_TYPE"]["value"] == "cluster"
    assert env["REDIS_URL"]["value"] == values["redis"]["url"]
    assert len(env["REDIS_URL"]["value"].split(",")) == 3
    assert env["REDIS_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "redis-cluster", "key": "redis-password"}
    assert "REDIS_PASSWORD" not in env and "REDIS_TLS" not in env
    assert env["FAILURE_MODE"]["value"] == "local"
    assert env["EXPECTED_REPLICAS"]["value"] == "9"  # autoscaling.maxReplicas
    assert env["GRPC_MAX_CONNECTION_AGE"]["value"] == "1h"
    assert env["SERVING_THREADS"]["value"] == "2"
    assert "replicas" not in deploy["spec"]
    assert "cluster" in notes(chart, values)
    # An explicit expectedReplicas wins over the HPA's maximum.
    env = values_of(container(server_deployment(render(chart, {**values, "expectedReplicas": 4}))))
    assert env["EXPECTED_REPLICAS"] == "4"


def test_redis_sentinel(chart):
    values = ci_values("redis-sentinel.yaml")
    c = container(server_deployment(render(chart, values)))
    env = env_of(c)
    names = [e["name"] for e in c["env"]]
    assert env["REDIS_TYPE"]["value"] == "sentinel"
    # mastername,sentinel,sentinel,...
    assert env["REDIS_URL"]["value"] == "mymaster," + values["redis"]["url"]
    assert env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {"name": "redis-sentinel-auth", "key": "password"}
    assert env["REDIS_AUTH"]["value"] == "ratekeeper:$(REDIS_PASSWORD)"
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_AUTH")
    text = notes(chart, values)
    assert "sentinel" in text and "master mymaster" in text


def test_redis_tls(chart):
    values = ci_values("redis-tls.yaml")
    deploy = server_deployment(render(chart, values))
    c = container(deploy)
    env = env_of(c)
    assert env["REDIS_TLS"]["value"] == "true"
    assert env["REDIS_URL"]["value"] == "redis-tls.data.svc.cluster.local:6380"  # host:port: fine now
    assert env["REDIS_AUTH"]["valueFrom"]["secretKeyRef"] == {"name": "redis-auth", "key": "redis-password"}
    m = mount(c, "redis-tls")
    assert m["readOnly"] is True and "subPath" not in m
    secret = volume(deploy, "redis-tls")["secret"]
    assert secret["secretName"] == "ratekeeper-redis-client-tls"
    assert {i["key"]: i["path"] for i in secret["items"]} == {"ca.crt": "ca.crt", "tls.crt": "tls.crt",
                                                            "tls.key": "tls.key"}
    d = m["mountPath"]
    assert (env["REDIS_TLS_CACERT"]["value"], env["REDIS_TLS_CLIENT_CERT"]["value"],
            env["REDIS_TLS_CLIENT_KEY"]["value"]) == (f"{d}/ca.crt", f"{d}/tls.crt", f"{d}/tls.key")
    # gRPC stays plaintext with native grpc probes.
    assert c["livenessProbe"]["grpc"] == {"port": 8081, "service": "liveness"}
    assert "TLS to Redis" in notes(chart, values)

    # The client certificate is optional: the CA alone...
    values["redis"]["tls"]["clientCert"] = False
    deploy = server_deployment(render(chart, values))
    env = values_of(container(deploy))
    assert "REDIS_TLS_CACERT" in env and not {"REDIS_TLS_CLIENT_CERT", "REDIS_TLS_CLIENT_KEY"} & env.keys()
    assert [i["key"] for i in volume(deploy, "redis-tls")["secret"]["items"]] == ["ca.crt"]
    # ...or no Secret at all: the system roots, nothing mounted.
    values["redis"]["tls"]["existingSecret"] = ""
    deploy = server_deployment(render(chart, values))
    env = values_of(container(deploy))
    assert env["REDIS_TLS"] == "true" and not TLS_FILE_ENV & env.keys()
    assert [v["name"] for v in deploy["spec"]["template"]["spec"]["volumes"]] == ["limits"]


def test_grpc_tls(chart):
    values = ci_values("grpc-tls.yaml")
    deploy = server_deployment(render(chart, values))
    c = container(deploy)
    env = values_of(c)
    m = mount(c, "grpc-tls")
    assert m["readOnly"] is True and "subPath" not in m, "a subPath mount never sees a renewed certificate"
    secret = volume(deploy, "grpc-tls")["secret"]
    assert secret["secretName"] == "ratekeeper-grpc-tls"
    assert {i["key"] for i in secret["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    d = m["mountPath"]
    assert (env["GRPC_TLS_CERT"], env["GRPC_TLS_KEY"], env["GRPC_TLS_CLIENT_CA"]) == \
        (f"{d}/tls.crt", f"{d}/tls.key", f"{d}/ca.crt")
    assert env["LIMIT_RESPONSE_HEADERS_ENABLED"] == "true"
    # Kubernetes' grpc probe cannot speak TLS: liveness checks the port,
    # readiness the plain HTTP port's /healthcheck (200 once Redis answered:
    # a pod whose Redis or CA is wrong is never Ready).
    assert c["livenessProbe"]["tcpSocket"] == {"port": 8081}
    assert c["readinessProbe"]["httpGet"] == {"path": "/healthcheck", "port": 8080}
    assert "HTTP_ADDR" not in env  # served on 0.0.0.0:8080, plain
    for probe in ("livenessProbe", "readinessProbe"):
        assert "grpc" not in c[probe]
        assert c[probe]["periodSeconds"]  # the timings still apply
    text = notes(chart, values)
    assert "-plaintext" not in text and "-cacert" in text and "-cert client.crt" in text

    # Server TLS only: no client CA, no ca.crt mounted.
    values["grpcTls"]["clientCA"] = False
    deploy = server_deployment(render(chart, values))
    assert "GRPC_TLS_CLIENT_CA" not in values_of(container(deploy))
    assert {i["key"] for i in volume(deploy, "grpc-tls")["secret"]["items"]} == {"tls.crt", "tls.key"}


def test_failure_mode_closed(chart):
    values = ci_values("failure-mode-closed.yaml")
    c = container(server_deployment(render(chart, values)))
    env = values_of(c)
    assert env["FAILURE_MODE"] == "closed"
    assert env["LIMIT_RESPONSE_HEADERS_ENABLED"] == "true"
    assert env["MAX_DETAILED_METRIC_SERIES"] == "2000"
    assert env["EXPECTED_REPLICAS"] == "3"
    # A rediss:// URL turns TLS on (system roots, nothing mounted).
    assert env["REDIS_TLS"] == "true" and env["REDIS_URL"] == "rediss://redis.data.svc:6380/1"
    assert not TLS_FILE_ENV & env.keys()
    # Readiness asks for "" (NOT_SERVING until Redis has answered).
    assert c["readinessProbe"]["grpc"] == {"port": 8081, "service": ""}
    assert c["livenessProbe"]["grpc"] == {"port": 8081, "service": "liveness"}
    assert "failureMode closed" in notes(chart, values)


def test_large_numbers_render_as_integers(chart):
    """Helm hands numbers to templates as floats: 1000000 must not become 1e+06."""
    values = {"maxDetailedMetricSeries": 1000000, "expectedReplicas": 2000000,
              "redis": {"url": "redis://r:6379", "connectTimeoutMs": 3000000}}
    env = values_of(container(server_deployment(render(chart, values))))
    assert env["MAX_DETAILED_METRIC_SERIES"] == "1000000"
    assert env["EXPECTED_REPLICAS"] == "2000000"
    assert env["REDIS_CONNECT_TIMEOUT_MS"] == "3000000"


# --- the rendered pod runs: the real binary with the rendered environment ------


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> dict[str, Path]:
    """A throwaway CA and one certificate it signed (for 127.0.0.1), as a Secret's keys."""
    d = tmp_path_factory.mktemp("certs")
    openssl(d, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
            "-days", "1", "-subj", "/CN=ca")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(d, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=rk")
    openssl(d, "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", "tls.crt", "-days", "1", "-extfile", "ext.cnf")
    return {name: d / name for name in ("ca.crt", "tls.crt", "tls.key")}


SECRET_VALUE = "s3cret"


def pod_environment(objects, root: Path, certs) -> dict[str, str]:
    """The server container's environment as the kubelet builds it, with its volumes
    laid out under root: ConfigMap data as files, Secret items from `certs`, every
    secretKeyRef as SECRET_VALUE, $(VAR) expanded from variables defined earlier."""
    deploy = server_deployment(objects)
    c = container(deploy)
    moved = {}
    for m in c["volumeMounts"]:
        src = volume(deploy, m["name"])
        target = root / m["mountPath"].lstrip("/")
        target.mkdir(parents=True)
        moved[m["mountPath"]] = target
        if "configMap" in src:
            found = find(objects, "ConfigMap", src["configMap"]["name"])
            data = found[0]["data"] if found else {"outside.yaml": "domain: outside\n"}  # existingConfigMap
            for name, content in data.items():
                (target / name).write_text(content)
        else:
            for item in src["secret"]["items"]:
                (target / item["path"]).write_bytes(certs[item["key"]].read_bytes())
    env: dict[str, str] = {}
    for e in c["env"]:
        if "valueFrom" in e:
            assert set(e["valueFrom"]) == {"secretKeyRef"}, e
            env[e["name"]] = SECRET_VALUE
            continue
        value = re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m[1], m[0]), e["value"])
        if value.startswith("/"):
            for mount_path, target in moved.items():
                if value == mount_path or value.startswith(mount_path + "/"):
                    value = str(target) + value[len(mount_path):]
        env[e["name"]] = value
    assert "$(" not in "".join(env.values()), env
    env["GRPC_ADDR"] = env["METRICS_ADDR"] = env["HTTP_ADDR"] = env["DEBUG_ADDR"] = "127.0.0.1:0"
    return env


@contextlib.contextmanager
def run_with_env(env: dict[str, str], log_path: Path):
    """ratekeeper with exactly this environment; yields its gRPC and HTTP addresses."""
    full_env = {"PATH": os.environ.get("PATH", ""), **env}
    json_logs = env.get("LOG_FORMAT", "").lower() == "json"
    with run_announcing([str(ratekeeper_bin())], log_path, LISTENING_JSON if json_logs else LISTENING,
                        "ratekeeper with the rendered environment", full_env) as (match, _):
        if json_logs:
            fields = json.loads(match[0])
            yield fields["grpc"], fields["http"]
        else:
            yield match[1], re.search(r" http=(\S+)", match[0])[1]


def health(channel, service: str) -> str:
    reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


@pytest.mark.parametrize("values_file", [None, *CI_VALUES], ids=lambda p: p.name if p else "defaults")
def test_rendered_pod_starts_and_answers_its_probes(chart, values_file, certs, tmp_path):
    """The binary accepts every rendered setting (names, formats, file paths) and
    answers the rendered probes the way the kubelet would ask them."""
    values = yaml.safe_load(values_file.read_text()) if values_file else None
    objects = render(chart, values)
    c = container(server_deployment(objects))
    env = pod_environment(objects, tmp_path / "pod", certs)
    if "REDIS_AUTH" in env:
        assert env["REDIS_AUTH"] in (SECRET_VALUE, f"ratekeeper:{SECRET_VALUE}")
    tls = "GRPC_TLS_CERT" in env
    with run_with_env(env, tmp_path / "ratekeeper.log") as (addr, http):
        if tls:
            # What the tcpSocket liveness probe does (the container's 8081 is this address)...
            assert c["livenessProbe"]["tcpSocket"] == {"port": 8081}
            socket.create_connection(("127.0.0.1", int(addr.rsplit(":", 1)[1])), timeout=5).close()
            # ...and the readiness probe's GET, plain HTTP (the container's 8080 is `http`).
            probe = c["readinessProbe"]["httpGet"]
            assert probe["port"] == 8080
            try:
                with urllib.request.urlopen(f"http://{http}{probe['path']}", timeout=5) as reply:
                    status = reply.status
            except urllib.error.HTTPError as error:
                status = error.code
            # No Redis is reachable here: ready only with the in-memory store.
            assert status == (500 if "REDIS_URL" in env else 200), status
            # ...and a client of the mounted CA (with a client certificate for mTLS) is served.
            client = (certs["tls.key"].read_bytes(), certs["tls.crt"].read_bytes()) \
                if "GRPC_TLS_CLIENT_CA" in env else (None, None)
            creds = grpc.ssl_channel_credentials(certs["ca.crt"].read_bytes(), *client)
            with grpc.secure_channel(addr, creds) as channel:
                assert health(channel, "liveness") == "SERVING"
            # A plaintext grpc probe could not have worked.
            with grpc.insecure_channel(addr) as channel, pytest.raises(grpc.RpcError):
                health(channel, "liveness")
        else:
            with grpc.insecure_channel(addr) as channel:
                assert health(channel, c["livenessProbe"]["grpc"]["service"]) == "SERVING"
                ready = health(channel, c["readinessProbe"]["grpc"]["service"])
            # No Redis is reachable here: ready only with the in-memory store.
            assert ready == ("NOT_SERVING" if "REDIS_URL" in env else "SERVING"), ready


# --- bad values fail at install time ------------------------------------------

BAD_VALUES = {
    "replicaCount-string": {"replicaCount": "x"},
    "unknown-top-level-key": {"replicas": 2},
    "redis-mode-unknown": {"redis": {"mode": "galaxy", "url": "redis://r:6379"}},
    "redis-mode-standalone-case": {"redis": {"mode": "Standalone"}},
    "log-format": {"log": {"format": "xml"}},
    "redis-url-with-password": {"redis": {"url": "redis://:hunter2@redis:6379"}},
    "redis-url-other-scheme": {"redis": {"url": "http://redis:6379"}},
    "redis-url-a-list-in-standalone": {"redis": {"url": "r1:6379,r2:6379"}},
    "unknown-nested-key": {"redis": {"embedded": {"enable": True}}},
    "limits-file-name": {"limits": {"api.json": "domain: x\n"}},
    "probe-unknown-key": {"livenessProbe": {"httpGet": {"path": "/"}}},
    "service-port-range": {"service": {"grpcPort": 70000}},
    "pdb-int-or-percent": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "half"}},
    # cluster and sentinel
    "cluster-without-url": {"redis": {"mode": "cluster"}},
    "cluster-with-embedded-redis": {"redis": {"mode": "cluster", "embedded": {"enabled": True}}},
    "cluster-url-with-scheme": {"redis": {"mode": "cluster", "url": "redis://r1:6379,redis://r2:6379"}},
    "cluster-url-without-port": {"redis": {"mode": "cluster", "url": "r1,r2"}},
    "cluster-url-with-password": {"redis": {"mode": "cluster", "url": "r1:6379,:pw@r2:6379"}},
    "sentinel-without-master-name": {"redis": {"mode": "sentinel", "url": "s1:26379,s2:26379"}},
    "sentinel-without-url": {"redis": {"mode": "sentinel", "sentinel": {"masterName": "m"}}},
    "sentinel-master-name-in-url": {"redis": {"mode": "sentinel", "url": "mymaster,s1:26379",
                                              "sentinel": {"masterName": "mymaster"}}},
    "sentinel-unknown-key": {"redis": {"sentinel": {"master": "m"}}},
    "auth-username-colon": {"redis": {"auth": {"username": "a:b"}}},
    # TLS
    "redis-tls-enabled-string": {"redis": {"tls": {"enabled": "yes"}}},
    "redis-tls-unknown-key": {"redis": {"tls": {"ca": "ca.crt"}}},
    "grpc-tls-client-ca-string": {"grpcTls": {"clientCA": "ca.crt"}},
    "grpc-tls-unknown-key": {"grpcTls": {"enabled": True}},
    # failure mode and the other settings
    "failure-mode-unknown": {"failureMode": "sometimes"},
    "failure-mode-case": {"failureMode": "Open"},
    "expected-replicas-zero": {"expectedReplicas": 0},
    "expected-replicas-string": {"expectedReplicas": "3"},
    "response-headers-string": {"responseHeaders": "true"},
    "max-connection-age-no-unit": {"maxConnectionAge": "3600"},
    "max-connection-age-words": {"maxConnectionAge": "1 hour"},
    "max-detailed-series-negative": {"maxDetailedMetricSeries": -1},
    "serving-threads-zero": {"servingThreads": 0},
    "serving-threads-string": {"servingThreads": "2"},
    # dashboards and alerts
    "dashboards-enabled-string": {"dashboards": {"enabled": "true"}},
    "dashboards-label-value-number": {"dashboards": {"labelValue": 1}},
    "dashboards-label-with-space": {"dashboards": {"label": "grafana dashboard"}},
    "dashboards-unknown-key": {"dashboards": {"folder": "x"}},
    "alerts-unknown-key": {"alerts": {"storeUp": {"for": "1m"}}},
    "alerts-for-no-unit": {"alerts": {"storeDown": {"for": "120"}}},
    "alerts-ratio-above-one": {"alerts": {"overLimitSurge": {"ratio": 50}}},
    "alerts-latency-zero": {"alerts": {"decisionLatency": {"seconds": 0}}},
    "alerts-latency-string": {"alerts": {"decisionLatency": {"seconds": "25ms"}}},
}


@pytest.mark.parametrize("values", BAD_VALUES.values(), ids=BAD_VALUES.keys())
def test_schema_refuses_bad_values(chart, values):
    with pytest.raises(helm_python.HelmValuesError):
        chart.validate_schema(values)
    with pytest.raises(helm_python.HelmValuesError):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    report = helm_python.lint(CHART, values, namespace=NAMESPACE)
    assert any(m["severity"] == 3 for m in report["messages"]), report


BAD_COMBINATIONS = {
    "replicas-without-redis": ({"replicaCount": 3}, "shared Redis"),
    "hpa-without-redis": ({"autoscaling": {"enabled": True}}, "shared Redis"),
    "url-and-embedded": ({"redis": {"url": "redis://r:6379", "embedded": {"enabled": True}}}, "exclusive"),
    "secret-without-redis": ({"redis": {"auth": {"existingSecret": "s"}}}, "needs a Redis"),
    "pdb-both": ({"podDisruptionBudget": {"enabled": True, "minAvailable": 1, "maxUnavailable": 1}}, "exactly one"),
    "redis-tls-without-redis": ({"redis": {"tls": {"enabled": True}}}, "needs a Redis"),
    "redis-tls-embedded": ({"redis": {"embedded": {"enabled": True}, "tls": {"enabled": True}}}, "no TLS"),
    "redis-tls-secret-not-enabled": ({"redis": {"url": "redis://r:6379", "tls": {"existingSecret": "t"}}},
                                     "redis.tls.enabled"),
    "redis-tls-secret-unused": ({"redis": {"url": "r:6379", "tls": {"enabled": True, "existingSecret": "t",
                                                                    "caCert": False}}}, "unused"),
    "grpc-client-ca-without-secret": ({"grpcTls": {"clientCA": True}}, "grpcTls.existingSecret"),
}


@pytest.mark.parametrize("values,message", BAD_COMBINATIONS.values(), ids=BAD_COMBINATIONS.keys())
def test_template_refuses_bad_combinations(chart, values, message):
    chart.validate_schema(values)  # each value is fine on its own
    with pytest.raises(helm_python.HelmRenderError, match=message):
        chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_chart_metadata(chart):
    meta = chart.metadata
    assert meta["apiVersion"] == "v2" and meta["name"] == "ratekeeper"
    assert meta["appVersion"] == "0.1.0"
    schema = chart.schema
    assert schema["additionalProperties"] is False
    assert schema["properties"]["redis"]["properties"]["mode"]["enum"] == ["standalone", "cluster", "sentinel"]
    assert schema["properties"]["failureMode"]["enum"] == ["open", "closed", "unavailable", "local"]
    # values.yaml's top-level keys are exactly the schema's (global aside).
    assert set(chart.values) == set(schema["properties"]) - {"global"}
