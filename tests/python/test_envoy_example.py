"""examples/envoy: the Envoy bootstrap and its limits file agree, and ratekeeper serves them.

No Envoy runs here. The bootstrap is parsed into Envoy's own message classes
(envoy-data-plane, generated from Envoy's protos: an unknown or misspelt field
anywhere, typed_config included, fails), its rate limit settings are checked,
every descriptor its route actions produce is matched against the limits file,
and ratekeeper, started on examples/envoy/limits, answers those descriptors
with the limits the file sets.
"""
from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import yaml

# Importing these registers their messages for google.protobuf.Any (typed_config).
import envoy_data_plane.envoy.extensions.filters.http.ratelimit.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.filters.http.router.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.upstreams.http.v3  # noqa: F401
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

from conftest import REPO, run_server
from rls_client import RateLimitResponseCode, RateLimitResponseRateLimitUnit, RlsClient, wait_for_fresh_window

EXAMPLE = REPO / "examples" / "envoy"
ENVOY_YAML = EXAMPLE / "envoy.yaml"
LIMITS_DIR = EXAMPLE / "limits"
LIMITS_FILE = LIMITS_DIR / "envoy-example.yaml"

RATELIMIT_FILTER = "envoy.filters.http.ratelimit"
RATELIMIT_TYPE = "type.googleapis.com/envoy.extensions.filters.http.ratelimit.v3.RateLimit"
HCM_TYPE = "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager"
HTTP_OPTIONS = "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"

# Sample values for the descriptor keys Envoy produces (see descriptor_keys()).
SAMPLE = {"remote_address": "203.0.113.7", "plan": "free", "user_id": "alice"}


@pytest.fixture(scope="module")
def envoy() -> dict:
    return yaml.safe_load(ENVOY_YAML.read_text())


@pytest.fixture(scope="module")
def limits() -> dict:
    return yaml.safe_load(LIMITS_FILE.read_text())


def hcm_configs(envoy):
    for listener in envoy["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                if f["typed_config"]["@type"] == HCM_TYPE:
                    yield f["typed_config"]


def ratelimit_filter(envoy) -> dict:
    [hcm] = list(hcm_configs(envoy))
    filters = hcm["http_filters"]
    [rl] = [f for f in filters if f["name"] == RATELIMIT_FILTER]
    assert filters[-1]["name"] == "envoy.filters.http.router", "the router must be the last HTTP filter"
    assert filters.index(rl) < len(filters) - 1
    return rl["typed_config"]


def cluster(envoy, name) -> dict:
    [c] = [c for c in envoy["static_resources"]["clusters"] if c["name"] == name]
    return c


def route_rate_limits(envoy) -> list[list[dict]]:
    """The `actions` lists of every route's (and virtual host's) rate_limits."""
    out = []
    for hcm in hcm_configs(envoy):
        for vhost in hcm["route_config"]["virtual_hosts"]:
            out += [rl["actions"] for rl in vhost.get("rate_limits", [])]
            for route in vhost["routes"]:
                out += [rl["actions"] for rl in route.get("route", {}).get("rate_limits", [])]
    return out


def descriptor_keys(actions: list[dict]) -> list[str]:
    """The entry keys one `actions` list produces, in order (Envoy's naming)."""
    keys = []
    for action in actions:
        [(kind, spec)] = action.items()
        if kind == "remote_address":
            keys.append("remote_address")
        elif kind == "request_headers":
            keys.append(spec["descriptor_key"])
        elif kind == "generic_key":
            keys.append(spec.get("descriptor_key") or "generic_key")
        elif kind == "header_value_match":
            keys.append(spec.get("descriptor_key") or "header_match")
        else:
            pytest.fail(f"action {kind} not understood by this test")
    return keys


def limit_for(limits: dict, entries: list[tuple[str, str]]):
    """envoyproxy/ratelimit's matching, for the example's shapes (exact value, else value-less key):
    the node reached by the last entry, or None."""
    level = limits["descriptors"]
    node = None
    for key, value in entries:
        candidates = [d for d in level if d["key"] == key and d.get("value") == value] or \
                     [d for d in level if d["key"] == key and "value" not in d]
        if not candidates:
            return None
        node = candidates[0]
        level = node.get("descriptors", [])
    return node.get("rate_limit") if node else None


# --- the bootstrap -------------------------------------------------------------


def test_bootstrap_is_valid_for_envoys_protos(envoy):
    bootstrap = Bootstrap.from_dict(envoy)
    assert [c.name for c in bootstrap.static_resources.clusters] == ["ratekeeper", "backend"]
    # The check is real: a misspelt field in the filter's typed_config is refused.
    broken = copy.deepcopy(envoy)
    rl = ratelimit_filter(broken)
    rl["failure_mode_dney"] = rl.pop("failure_mode_deny")
    with pytest.raises(KeyError, match="failure_mode_dney"):
        Bootstrap.from_dict(broken)


def test_ratelimit_filter_settings(envoy, limits):
    rl = ratelimit_filter(envoy)
    assert rl["@type"] == RATELIMIT_TYPE
    assert rl["domain"] == limits["domain"] == "envoy-example"
    assert rl["failure_mode_deny"] is False
    assert rl["enable_x_ratelimit_headers"] == "DRAFT_VERSION_03"
    bootstrap = Bootstrap.from_dict(envoy)  # parsed durations: a real, short deadline
    hcm = bootstrap.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.unpack()
    [parsed] = [f for f in hcm.http_filters if f.name == RATELIMIT_FILTER]
    deadline = parsed.typed_config.unpack().timeout
    assert timedelta(0) < deadline <= timedelta(seconds=1)
    service = rl["rate_limit_service"]
    assert service["transport_api_version"] == "V3"
    assert service["grpc_service"]["envoy_grpc"]["cluster_name"] == "ratekeeper"


def test_ratekeeper_cluster_is_http2_on_8081(envoy):
    c = cluster(envoy, "ratekeeper")
    options = c["typed_extension_protocol_options"][HTTP_OPTIONS]
    assert options["@type"] == f"type.googleapis.com/{HTTP_OPTIONS}"
    assert "http2_protocol_options" in options["explicit_http_config"]
    [endpoint] = [e["endpoint"]["address"]["socket_address"]
                  for group in c["load_assignment"]["endpoints"] for e in group["lb_endpoints"]]
    assert endpoint == {"address": "ratekeeper", "port_value": 8081}
    # The backend is plain HTTP/1.1: no HTTP/2 options there.
    assert "typed_extension_protocol_options" not in cluster(envoy, "backend")


def test_route_actions_produce_the_expected_descriptors(envoy):
    produced = [descriptor_keys(actions) for actions in route_rate_limits(envoy)]
    assert produced == [["remote_address"], ["plan", "user_id"]]
    headers = {a["request_headers"]["descriptor_key"]: a["request_headers"]["header_name"]
               for actions in route_rate_limits(envoy) for a in actions if "request_headers" in a}
    assert headers == {"plan": "x-plan", "user_id": "x-user-id"}


def test_every_descriptor_has_a_limit(envoy, limits):
    """Each descriptor Envoy sends reaches a rule in the limits file."""
    for actions in route_rate_limits(envoy):
        keys = descriptor_keys(actions)
        assert limit_for(limits, [(k, SAMPLE[k]) for k in keys]), keys
    # and the file has no top-level key Envoy never sends
    sent = {keys[0] for keys in map(descriptor_keys, route_rate_limits(envoy))}
    assert {d["key"] for d in limits["descriptors"]} <= sent


# --- ratekeeper serves the example limits -------------------------------------


@pytest.fixture(scope="module")
def example_rls(tmp_path_factory):
    log = tmp_path_factory.mktemp("envoy-example") / "ratekeeper.log"
    with run_server(LIMITS_DIR, log) as server, RlsClient(server.grpc_addr) as client:
        yield client


@pytest.mark.parametrize("plan,name,per_minute", [("free", "free", 60), ("pro", "pro", 1200),
                                                  ("gold", "unknown-plan", 10)])
def test_ratekeeper_answers_envoys_descriptors(envoy, limits, example_rls, plan, name, per_minute):
    wait_for_fresh_window(60)
    values = {**SAMPLE, "plan": plan, "user_id": f"user-{plan}"}
    descriptors = [[(k, values[k]) for k in descriptor_keys(a)] for a in route_rate_limits(envoy)]
    resp = example_rls.should_rate_limit(ratelimit_filter(envoy)["domain"], descriptors)
    assert resp.overall_code == RateLimitResponseCode.OK
    by_key = dict(zip((d[0][0] for d in descriptors), resp.statuses))
    addr = by_key["remote_address"].current_limit
    assert addr is not None
    file_addr = limit_for(limits, [("remote_address", SAMPLE["remote_address"])])
    assert addr.requests_per_unit == file_addr["requests_per_unit"]
    assert addr.unit == RateLimitResponseRateLimitUnit[file_addr["unit"].upper()]
    user = by_key["plan"].current_limit
    assert user is not None and (user.name, user.requests_per_unit) == (name, per_minute)
    assert user.unit == RateLimitResponseRateLimitUnit.MINUTE
    assert by_key["plan"].limit_remaining == per_minute - 1


def test_ratekeeper_unlimited_plan(example_rls):
    resp = example_rls.should_rate_limit("envoy-example", [[("plan", "internal"), ("user_id", "svc")]])
    assert resp.overall_code == RateLimitResponseCode.OK
    assert resp.statuses[0].limit_remaining == 2**32 - 1
