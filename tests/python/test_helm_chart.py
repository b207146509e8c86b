"""The Helm chart (helm/ratekeeper): lint, render and validate, offline.

Helm's own engine renders the chart (PyPI helm-python-sdk: Helm's Go SDK
through a C ABI, no helm binary, no cluster), with the default values and with
each helm/ratekeeper/ci/*.yaml. Every rendered object is checked against the
Kubernetes 1.30 schemas in strict mode (PyPI kubernetes-validate: unknown
fields fail); CRD kinds (ServiceMonitor) have no schema there, so only their
apiVersion/kind and the fields ratekeeper relies on are checked.
"""
from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import helm_python
import kubernetes_validate
import pytest
import yaml

from conftest import REPO, ratekeeper_bin, run_server
from rls_client import RlsClient

CHART = REPO / "helm" / "ratekeeper"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
K8S_VERSION = "1.30"
RELEASE, NAMESPACE = "rk", "rate"
FULLNAME = f"{RELEASE}-ratekeeper"
LIMITS_DIR = "/etc/ratekeeper/limits"
# Kinds served by CRDs, not by Kubernetes itself: apiVersion -> kinds.
CRD_KINDS = {"monitoring.coreos.com/v1": {"ServiceMonitor"}}
# Env vars the chart may set that the binary does not read itself.
CHART_ONLY_ENV = {"REDIS_PASSWORD"}  # expanded into REDIS_URL by Kubernetes


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
            "existing-configmap.yaml"} <= names


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
    assert {p["name"]: p["containerPort"] for p in c["ports"]} == {"grpc": 8081, "metrics": 9090}

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
    known = set(re.findall(r"\[env: ([A-Z0-9_]+)=", help_text))
    assert {"CONFIG_DIR", "REDIS_URL", "LOG_FORMAT"} <= known, help_text
    for values in [None, ci_values("existing-secret.yaml"), ci_values("redis-embedded.yaml")]:
        env = env_of(container(server_deployment(render(chart, values))))
        assert set(env) - CHART_ONLY_ENV <= known, set(env) - CHART_ONLY_ENV - known
    env = env_of(container(server_deployment(render(chart))))
    assert env["CONFIG_DIR"]["value"] == LIMITS_DIR
    assert env["GRPC_ADDR"]["value"].endswith(":8081")
    assert env["METRICS_ADDR"]["value"].endswith(":9090")
    assert env["LOG_FORMAT"]["value"] in ("text", "json")
    assert "REDIS_URL" not in env  # no Redis configured: the in-memory store
    assert "single replica" in notes(chart)


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


def test_existing_secret_password_via_dependent_env(chart):
    values = ci_values("existing-secret.yaml")
    objects = render(chart, values)
    c = container(server_deployment(objects))
    names = [e["name"] for e in c["env"]]
    env = env_of(c)
    ref = env["REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": values["redis"]["auth"]["existingSecret"],
                   "key": values["redis"]["auth"]["existingSecretPasswordKey"]}
    # Kubernetes expands $(VAR) only from variables defined earlier in the list.
    assert names.index("REDIS_PASSWORD") < names.index("REDIS_URL")
    assert env["REDIS_URL"]["value"] == \
        "redis://ratekeeper:$(REDIS_PASSWORD)@redis-master.data.svc.cluster.local:6379/2"
    assert env["REDIS_POOL_SIZE"]["value"] == "8"
    assert env["REDIS_TIMEOUT_MS"]["value"] == "50"
    assert env["REDIS_CONNECT_TIMEOUT_MS"]["value"] == "2000"
    assert env["CACHE_KEY_PREFIX"]["value"] == "prod:rk:"
    assert not find(objects, "Secret"), "the chart must not create or copy the Secret"
    assert server_deployment(objects)["spec"]["replicas"] == 3


def test_redis_embedded(chart):
    objects = render(chart, ci_values("redis-embedded.yaml"))
    redis_name = f"{FULLNAME}-redis"
    redis = one(objects, "Deployment", redis_name)
    redis_svc = one(objects, "Service", redis_name)
    env = env_of(container(server_deployment(objects)))
    assert env["REDIS_URL"]["value"] == f"redis://{redis_name}:6379"
    assert "REDIS_PASSWORD" not in env
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


# --- bad values fail at install time ------------------------------------------

BAD_VALUES = {
    "replicaCount-string": {"replicaCount": "x"},
    "unknown-top-level-key": {"replicas": 2},
    "redis-mode-not-implemented": {"redis": {"mode": "cluster"}},
    "log-format": {"log": {"format": "xml"}},
    "redis-url-with-password": {"redis": {"url": "redis://:hunter2@redis:6379"}},
    "redis-url-not-a-url": {"redis": {"url": "redis:6379"}},
    "unknown-nested-key": {"redis": {"embedded": {"enable": True}}},
    "limits-file-name": {"limits": {"api.json": "domain: x\n"}},
    "probe-unknown-key": {"livenessProbe": {"httpGet": {"path": "/"}}},
    "service-port-range": {"service": {"grpcPort": 70000}},
    "pdb-int-or-percent": {"podDisruptionBudget": {"enabled": True, "maxUnavailable": "half"}},
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
    assert schema["properties"]["redis"]["properties"]["mode"]["enum"] == ["standalone"]
    # values.yaml's top-level keys are exactly the schema's (global aside).
    assert set(chart.values) == set(schema["properties"]) - {"global"}
