"""examples/envoy/token-budget.yaml: token budgets charged after the fact.

No Envoy runs here. The bootstrap is parsed into Envoy's own message classes
(envoy-data-plane, generated from Envoy's protos: an unknown or misspelt
field anywhere, typed_config included, fails); the route's two rate limits
are checked (a request-phase check with hits_addend 0, a charge on stream
done with hits_addend from the dynamic metadata the Lua filter sets); and
ratekeeper, started on examples/envoy/token-limits, answers the descriptors
Envoy would send in that flow as issue #23 asks: check OK, a charge past the
budget OVER_LIMIT and recorded, the next check refused.
"""
from __future__ import annotations

import copy
import re

import pytest
import yaml

# Importing these registers their messages for google.protobuf.Any (typed_config).
import envoy_data_plane.envoy.extensions.filters.http.lua.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.filters.http.ratelimit.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.filters.http.router.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.filters.network.http_connection_manager.v3  # noqa: F401
import envoy_data_plane.envoy.extensions.upstreams.http.v3  # noqa: F401
from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

from conftest import REPO, run_server
from rls_client import RateLimitResponseCode as Code, RlsClient, descriptor, wait_for_fresh_window

EXAMPLE = REPO / "examples" / "envoy"
ENVOY_YAML = EXAMPLE / "token-budget.yaml"
LIMITS_DIR = EXAMPLE / "token-limits"
LIMITS_FILE = LIMITS_DIR / "llm-tokens.yaml"
RATELIMIT_FILTER = "envoy.filters.http.ratelimit"


@pytest.fixture(scope="module")
def envoy() -> dict:
    return yaml.safe_load(ENVOY_YAML.read_text())


@pytest.fixture(scope="module")
def limits() -> dict:
    return yaml.safe_load(LIMITS_FILE.read_text())


def hcm(envoy) -> dict:
    [chain] = envoy["static_resources"]["listeners"][0]["filter_chains"]
    [f] = chain["filters"]
    return f["typed_config"]


def route_rate_limits(envoy) -> list[dict]:
    [vhost] = hcm(envoy)["route_config"]["virtual_hosts"]
    [route] = vhost["routes"]
    return route["typed_per_filter_config"][RATELIMIT_FILTER]["rate_limits"]


def test_bootstrap_is_valid_for_envoys_protos(envoy):
    bootstrap = Bootstrap.from_dict(envoy)
    assert [c.name for c in bootstrap.static_resources.clusters] == ["ratekeeper", "model"]
    # The check reaches the per-route config: a misspelt field there is refused.
    broken = copy.deepcopy(envoy)
    charge = route_rate_limits(broken)[1]
    charge["apply_on_stream_dne"] = charge.pop("apply_on_stream_done")
    with pytest.raises(KeyError, match="apply_on_stream_dne"):
        Bootstrap.from_dict(broken)


def test_a_check_before_and_a_charge_after_the_response(envoy, limits):
    check, charge = route_rate_limits(envoy)
    assert check["actions"] == charge["actions"] == [
        {"request_headers": {"header_name": "x-user-id", "descriptor_key": "user_id"}}
    ]
    assert check["hits_addend"] == {"number": 0} and not check.get("apply_on_stream_done")
    assert charge["apply_on_stream_done"] is True
    # The charge's hits are the metadata the Lua filter writes.
    namespace, key = re.fullmatch(r"%DYNAMIC_METADATA\((\w+):(\w+)\)%", charge["hits_addend"]["format"]).groups()
    filters = hcm(envoy)["http_filters"]
    assert [f["name"] for f in filters] == ["envoy.filters.http.lua", RATELIMIT_FILTER, "envoy.filters.http.router"]
    lua = filters[0]["typed_config"]["default_source_code"]["inline_string"]
    assert f'dynamicMetadata():set("{namespace}", "{key}", used)' in lua
    assert filters[1]["typed_config"]["domain"] == limits["domain"] == "llm-tokens"


@pytest.fixture(scope="module")
def rls(tmp_path_factory):
    log = tmp_path_factory.mktemp("token-budget") / "ratekeeper.log"
    with run_server(LIMITS_DIR, log) as server, RlsClient(server.grpc_addr) as client:
        yield client


def test_ratekeeper_records_the_charges_envoy_sends(rls, limits):
    """The issue's flow, as Envoy sends it for one user: 1,000 tokens a minute."""
    wait_for_fresh_window(60)
    domain = limits["domain"]

    def send(hits):
        return rls.should_rate_limit(domain, [descriptor([("user_id", "alice")], hits_addend=hits)])

    assert send(0).overall_code == Code.OK, "request phase: budget left"
    over = send(1500)
    assert over.overall_code == Code.OVER_LIMIT, "stream done: 1,500 tokens, recorded"
    refused = send(0)
    assert refused.overall_code == Code.OVER_LIMIT, "the next request is refused"
    assert refused.statuses[0].current_limit.name == "tokens_per_minute"
