"""gRPC over TLS and mutual TLS, with certificate rotation without a restart.

Certificates are throwaway ones made with the openssl CLI; clients are
grpcio secure channels speaking Envoy's own messages.
"""
from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import grpc
import pytest

from rls_client import RlsClient, descriptor


def openssl(cwd: Path, *args: str) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(cwd: Path, name: str) -> None:
    openssl(cwd, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key",
            "-out", f"{name}.crt", "-days", "1", "-subj", f"/CN={name}")


def make_cert(cwd: Path, name: str, ca: str, days: int = 1) -> None:
    (cwd / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl(cwd, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
    openssl(cwd, "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.crt", "-CAkey", f"{ca}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", str(days), "-extfile", "ext.cnf")


def make_cert_from(cwd: Path, name: str, ca: str, seconds: int) -> None:
    """A server certificate signed by `ca` that becomes valid `seconds`
    from now (`openssl ca -startdate`: OpenSSL 3.0's x509 sets no start)."""
    (cwd / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    db = cwd / f"{name}-db"
    db.mkdir()
    (db / "index.txt").write_text("")
    (db / "serial").write_text("1000\n")
    (cwd / f"{name}-ca.cnf").write_text(
        f"[ca]\ndefault_ca = rk\n[rk]\ndatabase = {db}/index.txt\nserial = {db}/serial\n"
        f"new_certs_dir = {db}\ndefault_md = sha256\npolicy = any\n[any]\ncommonName = supplied\n")
    openssl(cwd, "req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr",
            "-subj", f"/CN={name}")
    at = lambda s: time.strftime("%y%m%d%H%M%SZ", time.gmtime(time.time() + s))
    openssl(cwd, "ca", "-batch", "-config", f"{name}-ca.cnf", "-cert", f"{ca}.crt", "-keyfile", f"{ca}.key",
            "-in", f"{name}.csr", "-out", f"{name}.crt", "-extfile", "ext.cnf",
            "-startdate", at(seconds), "-enddate", at(86_400))


@pytest.fixture
def certs(tmp_path) -> Path:
    make_ca(tmp_path, "ca")
    make_cert(tmp_path, "server", "ca")
    make_cert(tmp_path, "client", "ca")
    return tmp_path


def ask(addr: str, root: Path | None, client: tuple[Path, Path] | None = None) -> str:
    """One ShouldRateLimit over TLS (or plaintext with root=None); the overall code's name."""
    if root is None:
        channel = grpc.insecure_channel(addr)
    else:
        key, chain = (client[1].read_bytes(), client[0].read_bytes()) if client else (None, None)
        creds = grpc.ssl_channel_credentials(root.read_bytes(), private_key=key, certificate_chain=chain)
        channel = grpc.secure_channel(addr, creds)
    with channel:
        with RlsClient(addr, channel=channel) as rls:
            resp = rls.should_rate_limit("compat", [descriptor({"remote_address": "10.9.9.9"})], timeout=3)
            return resp.overall_code.name


def rotate_to(certs: Path, name: str) -> None:
    """Writes certificate `name` and its key over the served ones, in place."""
    (certs / "server.key").write_bytes((certs / f"{name}.key").read_bytes())
    (certs / "server.crt").write_bytes((certs / f"{name}.crt").read_bytes())


def until_served(addr: str, ca: Path, client: tuple[Path, Path], why: str) -> None:
    """Waits until a handshake trusting `ca` succeeds (any answer: the
    test's many calls may take the limit), up to 10 s."""
    deadline = time.monotonic() + 10
    while True:
        try:
            ask(addr, ca, client)
            return
        except grpc.RpcError:
            assert time.monotonic() < deadline, why
            time.sleep(0.1)


def until_logged(server, text: str) -> None:
    """Waits until the server's log holds `text`, up to 10 s."""
    deadline = time.monotonic() + 10
    while text not in server.log():
        assert time.monotonic() < deadline, server.log()
        time.sleep(0.1)


def test_mutual_tls_and_rotation(start_server, certs):
    """Only clients with a certificate from the client CA get answers; the
    server certificate is replaced on disk and the next handshake uses it."""
    args = ("--grpc-tls-cert", str(certs / "server.crt"), "--grpc-tls-key", str(certs / "server.key"),
            "--grpc-tls-client-ca", str(certs / "ca.crt"), "--reload-interval-ms", "100")
    with start_server(*args) as server:
        addr = server.grpc_addr
        client = (certs / "client.crt", certs / "client.key")
        assert ask(addr, certs / "ca.crt", client) == "OK"
        for anonymous in ({"root": certs / "ca.crt"}, {"root": None}):
            with pytest.raises(grpc.RpcError):
                ask(addr, client=None, **anonymous)
        # A refused client is found from the logs, as theirs logs it at WARN.
        assert "the client's certificate was refused" in server.log()

        # Rotate: a new CA signs a new server certificate, written in place.
        make_ca(certs, "ca2")
        make_cert(certs, "server2", "ca2")
        rotate_to(certs, "server2")
        until_served(addr, certs / "ca2.crt", client, "the new certificate was never served")
        with pytest.raises(grpc.RpcError):
            ask(addr, certs / "ca.crt", client)  # the old server certificate is gone
        assert "TLS certificate reloaded" in server.log()

        # Rotated again by a copy that keeps the files' times (cp -p, tar,
        # rsync -t): told by the contents, not the modification times.
        make_ca(certs, "ca3")
        make_cert(certs, "server3", "ca3")
        served = (certs / "server.key", certs / "server.crt")
        times = [(p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in served]
        rotate_to(certs, "server3")
        for path, ns in zip(served, times):
            os.utime(path, ns=ns)
        until_served(addr, certs / "ca3.crt", client, "a copy with the old times was never served")

        # A rotation to a certificate that expired (valid for 0 days: until
        # the second it was made) is refused, and the one in force stays.
        make_cert(certs, "expired", "ca3", days=0)
        time.sleep(1.1)
        rotate_to(certs, "expired")
        until_logged(server, "the certificate is expired at")
        ask(addr, certs / "ca3.crt", client)  # still served

        # One not valid yet is refused too, and served once it is (its
        # files unchanged: looked at again while refused for its start).
        make_ca(certs, "ca4")
        make_cert_from(certs, "early", "ca4", seconds=3)
        rotate_to(certs, "early")
        until_logged(server, "the certificate is not valid before")
        ask(addr, certs / "ca3.crt", client)  # still served
        until_served(addr, certs / "ca4.crt", client, "a certificate that became valid was never served")
        assert server.log().count("the certificate is not valid before") == 1, server.log()
