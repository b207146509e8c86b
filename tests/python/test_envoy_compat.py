"""Envoy RLS v3 compatibility, spoken with Envoy's own message definitions.

Every request here is built from envoy-data-plane's classes (generated from
Envoy's protos) and sent with plain grpcio, as Envoy's ratelimit filter would.
The server's limits are the `compat` domain of conftest.LIMITS_YAML. Tests
share one server, so each uses descriptor values of its own (`uid`).
"""
from __future__ import annotations

import re
import uuid
import urllib.request
from datetime import timedelta

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from conftest import DOMAIN
from rls_client import (
    RateLimitRequest,
    RateLimitResponse,
    RateLimitResponseCode as Code,
    RateLimitResponseRateLimitUnit as LimitUnit,
    RateLimitUnit,
    descriptor,
    insecure_channel,
    summarize,
    wait_for_fresh_window,
)

OK, OVER_LIMIT = Code.OK, Code.OVER_LIMIT
U32_MAX = 4294967295
RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"


@pytest.fixture
def uid(request) -> str:
    """A descriptor value no other test uses, so counters start at zero."""
    return f"{request.node.name}-{uuid.uuid4().hex[:8]}"


def user(uid, **kw):
    """The plan=free, user_id=uid descriptor: 3 per minute, rule name `free`."""
    return descriptor([("plan", "free"), ("user_id", uid)], **kw)


def address(uid, **kw):
    """The remote_address=uid descriptor: 5 per hour, unnamed rule."""
    return descriptor([("remote_address", uid)], **kw)


def assert_limit(status, requests_per_unit, unit, name=""):
    limit = status.current_limit
    assert limit is not None, "current_limit missing"
    assert (limit.requests_per_unit, limit.unit, limit.name) == (requests_per_unit, unit, name)


def assert_invalid_argument(call):
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details(), "INVALID_ARGUMENT should say what is wrong"
    return raised.value.details()


# --- counting ---------------------------------------------------------------


def test_counts_down_to_zero_then_over_limit(rls, uid):
    """A nested rule (plan=free -> user_id) admits requests_per_unit hits per
    fixed window, reporting current_limit {requests_per_unit, unit, name},
    limit_remaining counting down and duration_until_reset within the window;
    the next hit is OVER_LIMIT, both per descriptor and overall."""
    wait_for_fresh_window(60)
    for remaining in (2, 1, 0):
        resp = rls.should_rate_limit(DOMAIN, [user(uid)])
        assert resp.overall_code == OK, summarize(resp)
        (status,) = resp.statuses
        assert status.code == OK
        assert_limit(status, 3, LimitUnit.MINUTE, "free")
        assert status.limit_remaining == remaining
        assert timedelta(0) < status.duration_until_reset <= timedelta(minutes=1)

    resp = rls.should_rate_limit(DOMAIN, [user(uid)])
    assert resp.overall_code == OVER_LIMIT, summarize(resp)
    (status,) = resp.statuses
    assert status.code == OVER_LIMIT
    assert_limit(status, 3, LimitUnit.MINUTE, "free")
    assert status.limit_remaining == 0
    assert timedelta(0) < status.duration_until_reset <= timedelta(minutes=1)


def test_two_descriptors_each_get_their_own_limit(rls, uid):
    """One status per descriptor, in request order, each with its own rule's
    limit (3/MINUTE named `free`, 5/HOUR unnamed) and counter."""
    wait_for_fresh_window(60)
    resp = rls.should_rate_limit(DOMAIN, [user(uid), address(uid)])
    assert resp.overall_code == OK, summarize(resp)
    first, second = resp.statuses
    assert_limit(first, 3, LimitUnit.MINUTE, "free")
    assert first.limit_remaining == 2
    assert first.duration_until_reset <= timedelta(minutes=1)
    assert_limit(second, 5, LimitUnit.HOUR)
    assert second.limit_remaining == 4
    assert timedelta(0) < second.duration_until_reset <= timedelta(hours=1)


def test_refused_request_counts_on_fixed_windows_as_there(rls, uid):
    """A file in envoyproxy/ratelimit's format answers as there: its fixed
    windows take charges, so a refused request is counted on every descriptor
    (ratekeeper's all-or-nothing spares only limits with `charges: drop`;
    tests/charges.rs)."""
    wait_for_fresh_window(60)
    rls.should_rate_limit(DOMAIN, [user(uid)], hits_addend=3)  # exhausts the user
    resp = rls.should_rate_limit(DOMAIN, [user(uid), address(uid)])
    assert resp.overall_code == OVER_LIMIT, summarize(resp)
    assert [s.code for s in resp.statuses] == [OVER_LIMIT, OK]

    resp = rls.should_rate_limit(DOMAIN, [address(uid)])
    assert resp.statuses[0].limit_remaining == 3, "the refused request was not counted"


def test_unmatched_descriptor_is_ok_without_limit(rls, uid):
    """A descriptor that matches no rule of a known domain is OK with no
    current_limit, and does not block the request's other descriptors."""
    resp = rls.should_rate_limit(DOMAIN, [descriptor([("no_such_key", uid)]), address(uid)])
    assert resp.overall_code == OK
    unmatched, matched = resp.statuses
    assert unmatched.code == OK and unmatched.current_limit is None
    assert_limit(matched, 5, LimitUnit.HOUR)


# --- hits_addend --------------------------------------------------------------


def test_request_hits_addend(rls, uid):
    """RateLimitRequest.hits_addend counts that many hits for every descriptor
    (0 means 1); a request that would exceed the limit is OVER_LIMIT."""
    wait_for_fresh_window(60)
    resp = rls.should_rate_limit(DOMAIN, [user(uid), address(uid)], hits_addend=2)
    assert resp.overall_code == OK, summarize(resp)
    assert [s.limit_remaining for s in resp.statuses] == [1, 3]

    resp = rls.should_rate_limit(DOMAIN, [user(uid)], hits_addend=2)
    assert resp.overall_code == OVER_LIMIT, summarize(resp)

    # The refused 2 were counted (the fixed window takes charges, as there):
    # 4 of 3, so the next hit is refused too.
    resp = rls.should_rate_limit(DOMAIN, [user(uid)], hits_addend=0)
    assert resp.overall_code == OVER_LIMIT, summarize(resp)
    assert resp.statuses[0].limit_remaining == 0


def test_descriptor_hits_addend_wins_over_request(rls, uid):
    """RateLimitDescriptor.hits_addend, when present, replaces the request's
    hits_addend for that descriptor only."""
    wait_for_fresh_window(60)
    resp = rls.should_rate_limit(DOMAIN, [user(uid, hits_addend=1), address(uid)], hits_addend=3)
    assert resp.overall_code == OK, summarize(resp)
    assert [s.limit_remaining for s in resp.statuses] == [2, 2]


def test_descriptor_hits_addend_zero_checks_only(rls, uid):
    """A present descriptor hits_addend of 0 reports the limit without
    consuming from it (even with a request-level hits_addend); at the limit it
    answers OVER_LIMIT, as the next hit would be."""
    wait_for_fresh_window(60)
    for _ in range(2):
        resp = rls.should_rate_limit(DOMAIN, [user(uid, hits_addend=0)], hits_addend=2)
        assert resp.overall_code == OK, summarize(resp)
        assert_limit(resp.statuses[0], 3, LimitUnit.MINUTE, "free")
        assert resp.statuses[0].limit_remaining == 3

    resp = rls.should_rate_limit(DOMAIN, [user(uid)], hits_addend=3)
    assert resp.statuses[0].limit_remaining == 0, "check-only requests were counted"
    resp = rls.should_rate_limit(DOMAIN, [user(uid, hits_addend=0)])
    assert resp.overall_code == OVER_LIMIT, summarize(resp)


# --- limit override -----------------------------------------------------------


def test_limit_override_applies_its_rate(rls, uid):
    """RateLimitDescriptor.limit sets the rate for that descriptor, with or
    without a configured rule, counted apart from the configured rule."""
    wait_for_fresh_window(60)
    override = (2, RateLimitUnit.HOUR)
    for remaining in (1, 0):
        resp = rls.should_rate_limit(DOMAIN, [descriptor([("no_rule", uid)], limit=override)])
        assert resp.overall_code == OK, summarize(resp)
        assert_limit(resp.statuses[0], 2, LimitUnit.HOUR)
        assert resp.statuses[0].limit_remaining == remaining
        assert timedelta(0) < resp.statuses[0].duration_until_reset <= timedelta(hours=1)
    resp = rls.should_rate_limit(DOMAIN, [descriptor([("no_rule", uid)], limit=override)])
    assert resp.overall_code == OVER_LIMIT, summarize(resp)

    resp = rls.should_rate_limit(DOMAIN, [user(uid, limit=(10, RateLimitUnit.DAY))])
    assert_limit(resp.statuses[0], 10, LimitUnit.DAY)
    assert resp.statuses[0].limit_remaining == 9
    resp = rls.should_rate_limit(DOMAIN, [user(uid)])
    assert resp.statuses[0].limit_remaining == 2, "the override used the configured rule's counter"


def test_limit_override_with_unknown_unit_is_invalid_argument(rls, uid):
    """A limit override whose unit is UNKNOWN cannot be applied: the call
    fails with INVALID_ARGUMENT and a message naming the problem."""
    bad = descriptor([("no_rule", uid)], limit=(5, RateLimitUnit.UNKNOWN))
    details = assert_invalid_argument(lambda: rls.should_rate_limit(DOMAIN, [bad]))
    assert "unit" in details


# --- domains and rules without counting ------------------------------------------


def test_unknown_domain_is_ok_without_limit(rls, uid):
    """A domain with no limits file allows everything: OK overall and per
    descriptor, no current_limit."""
    resp = rls.should_rate_limit(f"no-such-domain-{uid}", [address(uid), user(uid)])
    assert resp.overall_code == OK
    assert len(resp.statuses) == 2
    for status in resp.statuses:
        assert status.code == OK
        assert status.current_limit is None


def test_empty_domain_is_invalid_argument(rls, uid):
    """Like envoyproxy/ratelimit, an empty domain is INVALID_ARGUMENT."""
    assert_invalid_argument(lambda: rls.should_rate_limit("", [address(uid)]))


def test_empty_descriptor_list_is_invalid_argument(rls):
    """Like envoyproxy/ratelimit, an empty descriptor list is INVALID_ARGUMENT."""
    assert_invalid_argument(lambda: rls.should_rate_limit(DOMAIN, []))


def test_unlimited_rule(rls, uid):
    """An `unlimited: true` rule never limits: OK, limit_remaining is
    u32::MAX and there is no current_limit."""
    internal = descriptor([("plan", "internal"), ("user_id", uid)])
    for _ in range(5):
        resp = rls.should_rate_limit(DOMAIN, [internal], hits_addend=1000)
        assert resp.overall_code == OK, summarize(resp)
        (status,) = resp.statuses
        assert status.code == OK
        assert status.current_limit is None
        assert status.limit_remaining == U32_MAX


# --- health, metrics, lifecycle --------------------------------------------------


@pytest.mark.parametrize("service", ["", RLS_SERVICE, "liveness"])
def test_health_serving(rls_server, service):
    """grpc.health.v1.Health/Check reports SERVING for the server as a whole
    and for the rate limit service (what Envoy's and Kubernetes' gRPC health
    checks ask)."""
    with insecure_channel(rls_server.grpc_addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING


def test_health_unknown_service_not_found(rls_server):
    """Per the gRPC health protocol, an unknown service name is NOT_FOUND."""
    with insecure_channel(rls_server.grpc_addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND


SAMPLE = re.compile(r"^([A-Za-z_:][\w:]*)\{([^}]*)\}\s+(\S+)", re.M)
LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def scrape(server) -> str:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(server.metrics_url, timeout=5) as resp:
        assert resp.status == 200
        return resp.read().decode()


def sample(text, name, **labels) -> float:
    """The value of metric `name` with exactly these labels; 0 when absent."""
    for metric, raw_labels, value in SAMPLE.findall(text):
        if metric == name and dict(LABEL.findall(raw_labels)) == labels:
            return float(value)
    return 0.0


def test_metrics_count_hits_per_rule(rls, rls_server, uid):
    """GET /metrics serves Prometheus text with envoyproxy/ratelimit's per-rule
    counters: total_hits and over_limit, labelled by domain and rule path."""
    wait_for_fresh_window(60)
    rules = {"user": "plan_free.user_id", "addr": "remote_address"}
    before = scrape(rls_server)
    for _ in range(4):  # 3 within the limit, 1 over
        rls.should_rate_limit(DOMAIN, [user(uid)])
    rls.should_rate_limit(DOMAIN, [address(uid)], hits_addend=2)
    after = scrape(rls_server)

    def delta(name, rule):
        return sample(after, name, domain=DOMAIN, rule=rule) - sample(before, name, domain=DOMAIN, rule=rule)

    assert "ratekeeper_rate_limit_total_hits{" in after
    assert delta("ratekeeper_rate_limit_total_hits", rules["user"]) == 4
    assert delta("ratekeeper_rate_limit_over_limit", rules["user"]) == 1
    assert delta("ratekeeper_rate_limit_total_hits", rules["addr"]) == 2
    assert delta("ratekeeper_rate_limit_over_limit", rules["addr"]) == 0


def test_sigterm_stops_gracefully(start_server):
    """SIGTERM (what Kubernetes and Envoy's hot restart send) stops the server
    cleanly: exit code 0 within a few seconds, after serving requests."""
    from conftest import stop
    from rls_client import RlsClient

    with start_server() as server:
        with RlsClient(server.grpc_addr) as client:
            assert client.should_rate_limit(DOMAIN, [address("x")]).overall_code == OK
        code = stop(server.process)
        assert code == 0, f"exit code {code}\n{server.log()}"


# --- the caller's :authority ------------------------------------------------

# Envoy calling an `envoy_grpc` service with no `authority` set sends the
# cluster's name as :authority; Istio's and Contour's are not host names,
# and gRPC's C core dialling a Unix socket sends its path. hyper's h2 resets
# such a call; grpc-go (theirs) takes it. grpcio's encoder (Huffman, the
# dynamic table) sends the value first as a literal, then by index.
@pytest.mark.parametrize("authority", [
    "outbound|8081||ratelimit.default.svc.cluster.local",
    "extension/projectcontour/ratelimit",
])
def test_any_authority_is_answered_as_grpc_go_answers_it(rls_server, uid, authority):
    options = [("grpc.default_authority", authority), ("grpc.enable_http_proxy", 0)]
    with grpc.insecure_channel(rls_server.grpc_addr, options=options) as channel:
        call = channel.unary_unary(
            f"/{RLS_SERVICE}/ShouldRateLimit",
            request_serializer=bytes,
            response_deserializer=RateLimitResponse.parse,
        )
        codes = [call(bytes(RateLimitRequest(domain=DOMAIN, descriptors=[user(uid)]))).overall_code
                 for _ in range(4)]
    assert codes == [OK, OK, OK, OVER_LIMIT]


def test_a_unix_socket_takes_grpcios_default_authority(start_server, tmp_path, uid, monkeypatch):
    socket = tmp_path / "rls.sock"
    monkeypatch.setenv("GRPC_UDS", str(socket))
    with start_server():
        with grpc.insecure_channel(f"unix:{socket}") as channel:
            call = channel.unary_unary(
                f"/{RLS_SERVICE}/ShouldRateLimit",
                request_serializer=bytes,
                response_deserializer=RateLimitResponse.parse,
            )
            response = call(bytes(RateLimitRequest(domain=DOMAIN, descriptors=[user(uid)])))
    assert response.overall_code == OK
