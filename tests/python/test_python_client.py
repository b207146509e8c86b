"""examples/clients/python/ratekeeper_client.py against a running ratekeeper.

The client's stubs are generated here with grpcio-tools from the repository's
proto/ (into a temporary directory, as a user of the example would), so this
also checks that our trimmed protos interoperate with the server.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from datetime import timedelta

import grpc
import pytest

from conftest import CLIENT_DIR, DOMAIN, REPO
from rls_client import CHANNEL_OPTIONS, wait_for_fresh_window

FREE_PER_MINUTE = 3  # conftest's LIMITS_YAML: plan=free, user_id -> 3/minute, named "free"


@pytest.fixture(scope="module")
def client(rk, rls_server):
    with rk.RateLimitClient(rls_server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as c:
        yield c


def free_user():
    return {"plan": "free", "user_id": f"py-{uuid.uuid4().hex[:12]}"}


def test_stubs_come_from_our_protos(rk):
    from envoy.service.ratelimit.v3 import rls_pb2

    service = rls_pb2.DESCRIPTOR.services_by_name["RateLimitService"]
    assert service.full_name == "envoy.service.ratelimit.v3.RateLimitService"
    assert "ShouldRateLimit" in service.methods_by_name
    assert os.path.realpath(rls_pb2.__file__).startswith(str(rk.test_stubs_dir) + os.sep)


def test_counts_down_then_refuses(rk, client):
    wait_for_fresh_window(60)
    user = free_user()
    for remaining in range(FREE_PER_MINUTE - 1, -1, -1):
        d = client.should_rate_limit(DOMAIN, [user])
        assert d.allowed and d.error is None and d.retry_after is None
        [s] = d.statuses
        assert (s.code, s.remaining, s.over_limit) == ("OK", remaining, False)
        assert s.limit == rk.Limit(requests_per_unit=FREE_PER_MINUTE, unit="MINUTE", name="free")
        assert timedelta(0) < s.reset_after <= timedelta(seconds=60)
    refused = client.should_rate_limit(DOMAIN, [user])
    assert not refused.allowed
    [s] = refused.statuses
    assert s.code == "OVER_LIMIT" and s.over_limit and s.remaining == 0
    assert timedelta(0) < refused.retry_after <= timedelta(seconds=60)
    # Another user has their own counter.
    assert client.should_rate_limit(DOMAIN, [free_user()]).allowed


def test_hits_addend(client):
    wait_for_fresh_window(60)
    user = free_user()
    assert client.should_rate_limit(DOMAIN, [user], hits_addend=2).statuses[0].remaining == 1
    over = client.should_rate_limit(DOMAIN, [user], hits_addend=2)
    # Refused, and counted all the same: a fixed window of a file in
    # envoyproxy/ratelimit's format takes charges, as there (README,
    # "Charges after the fact"), so the next hit is refused too.
    assert not over.allowed and over.statuses[0].remaining == 0
    assert not client.should_rate_limit(DOMAIN, [user]).allowed


def test_several_descriptors_in_order(client):
    wait_for_fresh_window(60)
    spent = free_user()
    client.should_rate_limit(DOMAIN, [spent], hits_addend=FREE_PER_MINUTE)
    # A list of pairs works as well as a dict; statuses follow the request's order.
    d = client.should_rate_limit(DOMAIN, [[("plan", "internal"), ("user_id", "svc")], spent,
                                          {"no_such_key": "x"}])
    assert not d.allowed
    assert [s.code for s in d.statuses] == ["OK", "OVER_LIMIT", "OK"]
    assert d.statuses[0].remaining == 2**32 - 1  # unlimited
    assert d.statuses[2].limit is None and d.statuses[2].reset_after is None  # no rule matched


def test_unknown_domain_is_allowed(client):
    d = client.should_rate_limit("no-such-domain", [{"remote_address": "198.51.100.1"}])
    assert d.allowed and d.statuses[0].limit is None


def _closed_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def test_fail_open_when_unreachable(rk):
    target = _closed_port()
    with rk.RateLimitClient(target, timeout=2, fail_open=True, options=CHANNEL_OPTIONS) as c:
        d = c.should_rate_limit(DOMAIN, [free_user()])
        assert d.allowed and d.statuses == () and d.error.startswith("UNAVAILABLE")
    with rk.RateLimitClient(target, timeout=2, options=CHANNEL_OPTIONS) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.should_rate_limit(DOMAIN, [free_user()])
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_fail_open_when_the_server_answers_cancelled(rk):
    """tonic, ratekeeper's gRPC server, answers a call whose grpc-timeout
    passed there before the client's own timer fired CANCELLED (grpc-go:
    DEADLINE_EXCEEDED); the client never cancels a unary call itself, so
    fail_open takes it for no answer too. A server that answers every call
    so stands in for that race."""
    from concurrent.futures import ThreadPoolExecutor

    class Cancelled(grpc.GenericRpcHandler):
        def service(self, details):
            def answer(request, context):
                context.abort(grpc.StatusCode.CANCELLED, "Timeout expired")
            return grpc.unary_unary_rpc_method_handler(answer)

    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((Cancelled(),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with rk.RateLimitClient(f"127.0.0.1:{port}", timeout=2, fail_open=True, options=CHANNEL_OPTIONS) as c:
            d = c.should_rate_limit(DOMAIN, [free_user()])
            assert d.allowed and d.error.startswith("CANCELLED")
    finally:
        server.stop(None)


def test_bad_request_is_raised_even_when_failing_open(rk, rls_server):
    with rk.RateLimitClient(rls_server.grpc_addr, timeout=5, fail_open=True, options=CHANNEL_OPTIONS) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.should_rate_limit(DOMAIN, [{"": "empty key"}])
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_command_line(rls_server, tmp_path):
    """The script compiles its stubs at start (load_stubs) and leaves none behind."""
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("http_proxy", "https_proxy", "grpc_proxy")}
    env["no_proxy"] = env["NO_PROXY"] = "127.0.0.1,localhost"
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, str(CLIENT_DIR / "ratekeeper_client.py"), rls_server.grpc_addr, DOMAIN,
         "plan=internal", "user_id=cli"],
        capture_output=True, text=True, timeout=60, env=env,
    )
    assert out.returncode == 0, out.stderr
    assert "allowed=True" in out.stdout and "remaining=4294967295" in out.stdout, out.stdout
    assert list(tmp_path.iterdir()) == []


def test_the_client_copied_out_of_the_repository_imports_and_asks_for_the_protos(tmp_path):
    """A user copies the one file: it imports, generates its stubs from a
    proto/ it is given, and without one says what it needs."""
    shutil.copy(CLIENT_DIR / "ratekeeper_client.py", tmp_path)
    script = (
        "import sys, ratekeeper_client as rk\n"
        "try:\n"
        "    rk.generate_stubs('gen')\n"
        "except FileNotFoundError as e:\n"
        "    print('refused:', e)\n"
        "rk.generate_stubs('gen', proto_dir=sys.argv[1])\n"
        "from ratekeeper.v1 import budget_pb2\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", script, str(REPO / "proto")], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "refused: " in out.stdout and "proto_dir" in out.stdout and out.stdout.endswith("ok\n"), out.stdout
