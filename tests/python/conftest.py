"""Starts the ratekeeper binary on loopback ports for the Python compatibility tests.

The binary is `$RATEKEEPER_BIN`, by default target/debug/ratekeeper of this
repository (build it first with `cargo build`). Started with port 0 it prints
one line on stdout once it listens:
    listening grpc=127.0.0.1:PORT metrics=127.0.0.1:PORT http=127.0.0.1:PORT debug=127.0.0.1:PORT
Every server started here is stopped with SIGTERM (SIGKILL after 5 s) at
teardown, and on Linux also dies with the test process.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from rls_client import RlsClient

REPO = Path(__file__).resolve().parent.parent.parent
DEFAULT_BIN = REPO / "target" / "debug" / "ratekeeper"
STARTUP_TIMEOUT_S = 20
STOP_TIMEOUT_S = 5
LISTENING = re.compile(r"^listening grpc=(\S+) metrics=(\S+)(?: \S+)*$")

DOMAIN = "compat"

# envoyproxy/ratelimit's YAML format, one domain per file.
LIMITS_YAML = f"""\
domain: {DOMAIN}
descriptors:
  # Envoy's generic_key + request_headers style: plan then user.
  - key: plan
    value: free
    descriptors:
      - key: user_id
        rate_limit:
          name: free
          unit: minute
          requests_per_unit: 3
  - key: plan
    value: internal
    descriptors:
      - key: user_id
        rate_limit:
          unlimited: true
  # Envoy's remote_address action.
  - key: remote_address
    rate_limit:
      unit: hour
      requests_per_unit: 5
"""


@dataclass
class Server:
    grpc_addr: str
    metrics_addr: str
    pid: int
    process: subprocess.Popen
    log_path: Path

    @property
    def metrics_url(self) -> str:
        return f"http://{self.metrics_addr}/metrics"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""


def ratekeeper_bin() -> Path:
    path = Path(os.environ.get("RATEKEEPER_BIN") or DEFAULT_BIN)
    if not path.is_file():
        pytest.fail(f"ratekeeper binary not found at {path}: run `cargo build` or set RATEKEEPER_BIN")
    return path


# Linux: a server gets SIGTERM if the test process dies without a teardown.
# setpriv (util-linux) sets that and execs the server; not a preexec_fn, which
# forks a process whose other threads (grpcio's pollers) are gone, and grpcio's
# fork handlers have aborted such a child before its exec.
_SETPRIV = shutil.which("setpriv") if sys.platform.startswith("linux") else None


def _dying_with_parent(args: list) -> list:
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *args] if _SETPRIV else list(args)


def stop(process: subprocess.Popen) -> int:
    """SIGTERM, then SIGKILL if it has not exited within STOP_TIMEOUT_S; returns the exit code."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    if process.stdout:
        process.stdout.close()
    return process.returncode


@contextlib.contextmanager
def run_announcing(args: list, log_path: Path, pattern: re.Pattern, what: str, env: dict | None = None):
    """Runs args (stderr to log_path) until the block ends, stopped by PID.
    Waits for the first stdout line, which must match pattern (a server
    announcing its address), and keeps stdout drained after it; yields
    (match, process). Fails the test with the log if it does not start."""
    with open(log_path, "wb") as log:
        process = subprocess.Popen(
            _dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=log, env=env,
        )
    try:
        lines: queue.Queue = queue.Queue()

        def pump():  # hands over the first line, then keeps stdout drained
            for raw in process.stdout:
                lines.put(raw.decode(errors="replace").strip())
            lines.put(None)

        threading.Thread(target=pump, daemon=True).start()
        try:
            first = lines.get(timeout=STARTUP_TIMEOUT_S)
        except queue.Empty:
            first = f"<nothing within {STARTUP_TIMEOUT_S} s>"
        match = pattern.match(first or "")
        if not match:
            log_text = log_path.read_text(errors="replace")
            pytest.fail(f"{what} did not start (stdout: {first!r}, exit: {process.poll()}):\n{log_text}")
        yield match, process
    finally:
        stop(process)


@contextlib.contextmanager
def run_server(config_dir: Path, log_path: Path, *extra_args: str):
    """Runs ratekeeper on config_dir until the block ends; yields a Server."""
    args = [
        str(ratekeeper_bin()),
        "--config-dir", str(config_dir),
        "--grpc-addr", "127.0.0.1:0",
        "--metrics-addr", "127.0.0.1:0",
        "--http-addr", "127.0.0.1:0",
        "--debug-addr", "127.0.0.1:0",
        *extra_args,
    ]
    env = {**os.environ, "LOG_FORMAT": "text", "NO_COLOR": "1"}
    env.pop("REDIS_URL", None)  # the in-memory store: no Redis needed
    with run_announcing(args, log_path, LISTENING, "ratekeeper", env) as (match, process):
        yield Server(match[1], match[2], process.pid, process, log_path)


@contextlib.contextmanager
def run_redis(log_path: Path):
    """A redis-server of its own (loopback, a free port, no persistence)
    until the block ends, stopped by PID; yields its redis:// URL."""
    if not shutil.which("redis-server"):
        pytest.fail("redis-server not found: `make redis-server` installs it")
    with socket.socket() as probe:  # a free port (the kernel's pick)
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(_dying_with_parent(args), stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                    conn.sendall(b"PING\r\n")
                    if conn.recv(16).startswith(b"+PONG"):
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"redis-server did not start:\n{log_path.read_text(errors='replace')}")
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}"
    finally:
        stop(process)


@pytest.fixture(scope="session")
def limits_dir(tmp_path_factory) -> Path:
    """A limits directory holding the `compat` test domain."""
    path = tmp_path_factory.mktemp("limits")
    (path / f"{DOMAIN}.yaml").write_text(LIMITS_YAML)
    return path


@pytest.fixture(scope="session")
def rls_server(limits_dir, tmp_path_factory):
    """One ratekeeper for the whole session; tests use distinct descriptor values."""
    log_path = tmp_path_factory.mktemp("server") / "ratekeeper.log"
    with run_server(limits_dir, log_path) as server:
        yield server


@pytest.fixture(scope="session")
def rls(rls_server):
    """A ShouldRateLimit client connected to the session's server."""
    with RlsClient(rls_server.grpc_addr) as client:
        yield client


@pytest.fixture
def start_server(limits_dir, tmp_path):
    """run_server for tests that need a server of their own."""
    return lambda *extra: run_server(limits_dir, tmp_path / "ratekeeper.log", *extra)


# Concurrency leases (ratekeeper.v1.ConcurrencyService): a domain of its own,
# used by test_python_client_leases.py and test_ws_example.py.
CONCURRENCY_DOMAIN = "ws"
MAX_CONNECTIONS = 2
LEASE_TTL_S = 30
CONCURRENCY_YAML = f"""\
domain: {CONCURRENCY_DOMAIN}
concurrency:
  - key: user_id
    max_connections: {MAX_CONNECTIONS}
    lease_ttl: {LEASE_TTL_S}s
"""


@pytest.fixture(scope="session")
def concurrency_server(tmp_path_factory):
    """One ratekeeper whose limits hold the `ws` domain's `concurrency:` rule
    (MAX_CONNECTIONS per user_id); tests use distinct user ids."""
    limits = tmp_path_factory.mktemp("concurrency-limits")
    (limits / f"{CONCURRENCY_DOMAIN}.yaml").write_text(CONCURRENCY_YAML)
    log_path = tmp_path_factory.mktemp("concurrency-server") / "ratekeeper.log"
    with run_server(limits, log_path) as server:
        yield server


CLIENT_DIR = REPO / "examples" / "clients" / "python"


@pytest.fixture(scope="session")
def rk(tmp_path_factory):
    """The example client module (examples/clients/python), with stubs freshly
    generated from proto/ importable; `rk.test_stubs_dir` is where they are."""
    sys.path.insert(0, str(CLIENT_DIR))
    try:
        module = importlib.import_module("ratekeeper_client")
        out = module.generate_stubs(tmp_path_factory.mktemp("stubs"), REPO / "proto")
        assert (out / "envoy" / "service" / "ratelimit" / "v3" / "rls_pb2_grpc.py").is_file()
        assert (out / "ratekeeper" / "v1" / "concurrency_pb2_grpc.py").is_file()
        module.test_stubs_dir = out
        yield module
    finally:
        sys.path.remove(str(CLIENT_DIR))
