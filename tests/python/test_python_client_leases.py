"""Concurrency leases through examples/clients/python/ratekeeper_client.py,
against a running ratekeeper whose `ws` domain allows MAX_CONNECTIONS open
connections per user_id (conftest's CONCURRENCY_YAML).

Every test uses user ids of its own, so they share one server.
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import timedelta

import grpc
import pytest

from conftest import CONCURRENCY_DOMAIN, CONCURRENCY_YAML, LEASE_TTL_S, MAX_CONNECTIONS, run_server, stop
from rls_client import CHANNEL_OPTIONS

TTL = timedelta(seconds=LEASE_TTL_S)


@pytest.fixture(scope="module")
def client(rk, concurrency_server):
    with rk.RateLimitClient(concurrency_server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as c:
        yield c


def new_user() -> list:
    return [{"user_id": f"py-lease-{uuid.uuid4().hex[:12]}"}]


def eventually(predicate, timeout=3.0, interval=0.05):
    """Polls predicate until it returns a truthy value; returns the last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)


def test_acquire_up_to_the_limit_then_refused(rk, client):
    user = new_user()
    leases = []
    for n in range(1, MAX_CONNECTIONS + 1):
        lease = client.acquire_connection(CONCURRENCY_DOMAIN, user, holder="pytest")
        assert lease.granted and lease.lease_id and lease.error is None
        assert (lease.active, lease.limit) == (n, MAX_CONNECTIONS)
        assert lease.lease_ttl == TTL and lease.retry_after is None
        leases.append(lease.lease_id)
    assert len(set(leases)) == MAX_CONNECTIONS

    refused = client.acquire_connection(CONCURRENCY_DOMAIN, user)
    assert not refused.granted and refused.lease_id == ""
    assert (refused.active, refused.limit) == (MAX_CONNECTIONS, MAX_CONNECTIONS)
    # The soonest an existing lease expires unless renewed.
    assert timedelta(0) < refused.retry_after <= TTL

    # Another user has places of their own.
    other = client.acquire_connection(CONCURRENCY_DOMAIN, new_user())
    assert other.granted and other.active == 1
    client.release(leases + [other.lease_id])


def test_release_frees_a_place_and_is_idempotent(client):
    user = new_user()
    ids = [client.acquire_connection(CONCURRENCY_DOMAIN, user).lease_id for _ in range(MAX_CONNECTIONS)]
    assert not client.acquire_connection(CONCURRENCY_DOMAIN, user).granted

    client.release([ids[0]])
    client.release([ids[0]])  # again: not an error
    again = client.acquire_connection(CONCURRENCY_DOMAIN, user)
    assert again.granted and again.active == MAX_CONNECTIONS

    # A released lease is reported lost; a held one is extended.
    result = client.heartbeat([ids[0], ids[1]])
    assert result.lost == (ids[0],) and result.extended == (ids[1],)
    client.release([ids[1], again.lease_id])
    assert client.acquire_connection(CONCURRENCY_DOMAIN, user).active == 1


def test_heartbeat_extends_and_unrenewed_leases_expire(client):
    """Two leases with a 3 s TTL; only one is renewed at 1.5 s. At 3.6 s the
    other has expired (lost, and its place is free) and the renewed one
    still holds."""
    user = new_user()
    kept = client.acquire_connection(CONCURRENCY_DOMAIN, user, lease_ttl=3)
    dropped = client.acquire_connection(CONCURRENCY_DOMAIN, user, lease_ttl=timedelta(seconds=3))
    assert kept.granted and dropped.granted and kept.lease_ttl == timedelta(seconds=3)
    assert not client.acquire_connection(CONCURRENCY_DOMAIN, user).granted

    time.sleep(1.5)
    assert client.heartbeat([kept.lease_id]).extended == (kept.lease_id,)
    time.sleep(2.1)
    result = client.heartbeat([kept.lease_id, dropped.lease_id])
    assert result.extended == (kept.lease_id,) and result.lost == (dropped.lease_id,)

    fresh = client.acquire_connection(CONCURRENCY_DOMAIN, user)
    assert fresh.granted and fresh.active == MAX_CONNECTIONS  # kept + fresh
    client.release([kept.lease_id, fresh.lease_id])


def test_hold_context_manager_releases_on_exit(client):
    user = new_user()
    with client.hold(CONCURRENCY_DOMAIN, user, holder="pytest") as first:
        assert first.granted and first.lease_id and first.active == 1 and first.lease_ttl == TTL
        with client.hold(CONCURRENCY_DOMAIN, user) as second:
            assert second.granted and second.active == 2
            with client.hold(CONCURRENCY_DOMAIN, user) as third:
                assert not third.granted and third.lease_id == ""
                assert third.limit == MAX_CONNECTIONS and timedelta(0) < third.retry_after <= TTL
        # Leaving the block cancelled the stream: the server gives the lease
        # back at once (asynchronously, so allow it a moment), not after the TTL.
        assert eventually(lambda: client.heartbeat([second.lease_id]).lost), "the inner hold was not released"
        lease = client.acquire_connection(CONCURRENCY_DOMAIN, user)
        assert lease.granted and lease.active == 2
        client.release([lease.lease_id])
    assert eventually(lambda: client.heartbeat([first.lease_id]).lost), "the outer hold was not released"
    assert client.acquire_connection(CONCURRENCY_DOMAIN, user).active == 1


def test_hold_reports_a_lost_lease(client):
    """A held lease released elsewhere is found lost at the server's next
    refresh (a third of the 3 s TTL) and the stream says so."""
    lost = []
    seen = threading.Event()

    def on_lost(lease_id):
        lost.append(lease_id)
        seen.set()

    with client.hold(CONCURRENCY_DOMAIN, new_user(), lease_ttl=3, on_lost=on_lost) as lease:
        assert lease.granted
        client.release([lease.lease_id])
        assert seen.wait(5), "no lost event within 5 s"
    assert lost == [lease.lease_id]


def test_hold_reports_the_end_of_its_replica(rk, tmp_path):
    """A replica stopped under a Hold releases the lease and ends the stream
    (UNAVAILABLE): on_lost is told, as for a lost event; leaving the block
    afterwards (which cancels the stream) tells it nothing more."""
    limits = tmp_path / "limits"
    limits.mkdir()
    (limits / f"{CONCURRENCY_DOMAIN}.yaml").write_text(CONCURRENCY_YAML)
    lost = []
    seen = threading.Event()

    def on_lost(lease_id):
        lost.append(lease_id)
        seen.set()

    with run_server(limits, tmp_path / "ratekeeper.log") as server:
        with rk.RateLimitClient(server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as replica:
            with replica.hold(CONCURRENCY_DOMAIN, new_user(), on_lost=on_lost) as lease:
                assert lease.granted
                stop(server.process)
                assert seen.wait(5), "on_lost not called when the replica stopped"
    assert lost == [lease.lease_id]


def test_leaving_a_hold_is_not_a_loss(client):
    lost = []
    with client.hold(CONCURRENCY_DOMAIN, new_user(), on_lost=lost.append) as lease:
        assert lease.granted
    time.sleep(0.5)
    assert lost == []


def test_unlimited_descriptor_is_granted_without_a_lease(client):
    lease = client.acquire_connection(CONCURRENCY_DOMAIN, [{"plan": "free"}])
    assert lease.granted and lease.lease_id == "" and lease.limit == 0
    assert client.heartbeat([lease.lease_id]) == client.heartbeat([])
    client.release([lease.lease_id])  # nothing to give back
    other_domain = client.acquire_connection("no-such-domain", new_user())
    assert other_domain.granted and other_domain.lease_id == ""


def test_bad_requests_are_invalid_argument(client):
    with pytest.raises(grpc.RpcError) as e:
        client.heartbeat(["not-a-lease-id"])
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as e:
        client.acquire_connection(CONCURRENCY_DOMAIN, new_user(), lease_ttl=timedelta(hours=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_fail_open_grants_when_unreachable(rk):
    with rk.RateLimitClient("127.0.0.1:1", timeout=0.5, fail_open=True) as down:
        lease = down.acquire_connection(CONCURRENCY_DOMAIN, new_user())
        assert lease.granted and lease.lease_id == "" and lease.error.startswith("UNAVAILABLE")
        with down.hold(CONCURRENCY_DOMAIN, new_user()) as held:
            assert held.granted and held.error
