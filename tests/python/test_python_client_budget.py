"""Budgets (reserve, then settle) through examples/clients/python/ratekeeper_client.py,
against a running ratekeeper whose `budget` domain gives every user_id
BUDGET hits a minute, on the in-memory store and on a redis-server of its own.

Every test uses user ids of its own, so they share one server; those that
count a minute's budget start in a fresh minute.
"""
from __future__ import annotations

import contextlib
import time
import uuid
from datetime import timedelta

import grpc
import pytest

from conftest import run_redis, run_server
from rls_client import CHANNEL_OPTIONS, wait_for_fresh_window

DOMAIN = "budget"
BUDGET = 1000
LIMITS_YAML = f"""\
domain: {DOMAIN}
descriptors:
  - key: user_id
    rate_limit: {{unit: minute, requests_per_unit: {BUDGET}}}
  - key: plan
    value: internal
    rate_limit: {{unlimited: true}}
  - key: queue
    rate_limit: {{unit: minute, requests_per_unit: {BUDGET}, algorithm: leaky_bucket}}
"""
DEFAULT_TTL = timedelta(minutes=5)


@pytest.fixture(scope="module", params=["memory", "redis"])
def budget_server(request, tmp_path_factory):
    limits = tmp_path_factory.mktemp("budget-limits")
    (limits / f"{DOMAIN}.yaml").write_text(LIMITS_YAML)
    logs = tmp_path_factory.mktemp(f"budget-server-{request.param}")
    with contextlib.ExitStack() as stack:
        server_args = []
        if request.param == "redis":
            server_args = ["--redis-url", stack.enter_context(run_redis(logs / "redis.log"))]
        yield stack.enter_context(run_server(limits, logs / "ratekeeper.log", *server_args))


@pytest.fixture(scope="module")
def client(rk, budget_server):
    with rk.RateLimitClient(budget_server.grpc_addr, timeout=5, options=CHANNEL_OPTIONS) as c:
        yield c


@pytest.fixture
def user():
    """A user of its own, in a minute with at least 10 s left."""
    wait_for_fresh_window(60, margin_s=10)
    return [{"user_id": f"py-budget-{uuid.uuid4().hex[:12]}"}]


def test_stubs_include_the_budget_service(rk):
    from ratekeeper.v1 import budget_pb2

    service = budget_pb2.DESCRIPTOR.services_by_name["BudgetService"]
    assert set(service.methods_by_name) == {"Reserve", "Settle"}


def test_reserve_then_settle_gives_the_unused_estimate_back(rk, client, user):
    r = client.reserve(DOMAIN, user, estimate=100)
    assert r.granted and r.reservation_id and r.error is None
    assert r.statuses == (rk.BudgetStatus(remaining=BUDGET - 100, limit=BUDGET, over=False),)
    assert r.ttl == DEFAULT_TTL and r.retry_after is None

    s = client.settle(r.reservation_id, 40)
    assert (s.settled, s.already_settled) == (40, False)
    assert s.statuses == (rk.BudgetStatus(remaining=BUDGET - 40, limit=BUDGET, over=False),)

    # A retried settle answers as the first did and charges nothing more.
    for _ in range(2):
        again = client.settle(r.reservation_id, 99)
        assert (again.settled, again.already_settled) == (40, True)
        assert again.statuses[0].remaining == BUDGET - 40


def test_a_leaky_bucket_reservation_says_when_its_turn_comes(client):
    """1,000 a minute: 60 ms a hit, so a second reservation of 100 waits 6 s."""
    queue = [{"queue": f"py-queue-{uuid.uuid4().hex[:12]}"}]
    first, second = (client.reserve(DOMAIN, queue, 100) for _ in range(2))
    assert first.granted and second.granted
    assert first.wait == timedelta(0)
    assert timedelta(seconds=5.9) <= second.wait <= timedelta(seconds=6)
    assert client.reserve(DOMAIN, [{"user_id": "py-no-queue"}], 1).wait is None


def test_refused_when_the_estimate_does_not_fit(client, user):
    first = client.reserve(DOMAIN, user, estimate=600, ttl=30)
    assert first.granted and first.ttl == timedelta(seconds=30)
    refused = client.reserve(DOMAIN, user, estimate=600)
    assert not refused.granted and refused.reservation_id == ""
    assert refused.statuses[0].over and refused.statuses[0].remaining == BUDGET - 600
    # The window's end: when the estimate fits again.
    assert timedelta(0) < refused.retry_after <= timedelta(seconds=60)
    # Settling the first at less frees what it did not use.
    client.settle(first.reservation_id, 300)
    assert client.reserve(DOMAIN, user, estimate=600).granted


def test_budget_context_manager_settles_at_what_was_spent(rk, client, user):
    with client.budget(DOMAIN, user, estimate=500) as b:
        assert b.reservation.granted and b.reservation.statuses[0].remaining == BUDGET - 500
        b.spend(120)
        b.spend(30)
    assert (b.settlement.settled, b.settlement.statuses[0].remaining) == (150, BUDGET - 150)

    # Over the budget left (850): refused on entry, the block never runs.
    with pytest.raises(rk.BudgetExceeded) as refused:
        with client.budget(DOMAIN, user, estimate=900):
            pytest.fail("the block ran without a reservation")
    assert timedelta(0) < refused.value.retry_after <= timedelta(seconds=60)
    assert refused.value.statuses[0].over


def test_budget_settles_at_the_estimate_when_the_block_fails_unreported(client, user):
    """The work may have cost up to the estimate: charging it all is the
    safe side. A block that reported its cost before failing is settled at it."""
    with pytest.raises(RuntimeError):
        with client.budget(DOMAIN, user, estimate=300) as unreported:
            raise RuntimeError("the model call failed midway")
    assert unreported.settlement.settled == 300
    assert unreported.settlement.statuses[0].remaining == BUDGET - 300

    with pytest.raises(RuntimeError):
        with client.budget(DOMAIN, user, estimate=300) as reported:
            reported.spend(0)
            raise RuntimeError("failed before any work")
    assert reported.settlement.settled == 0
    assert reported.settlement.statuses[0].remaining == BUDGET - 300


def test_a_bad_spend_fails_in_the_block(client, user):
    """spend() refuses what is not a whole number of hits, or more than a
    settle takes, where it is called."""
    with pytest.raises(TypeError, match="whole number"):
        with client.budget(DOMAIN, user, estimate=100) as fractional:
            fractional.spend(12.0)
    assert fractional.settlement.settled == 100, "nothing reported: the estimate"

    with pytest.raises(ValueError, match=r"2\^32"):
        with client.budget(DOMAIN, user, estimate=100) as huge:
            huge.spend(2**32 + 1)
    assert huge.settlement.settled == 100 and huge.settle_error is None

    # After the block the reservation is settled: a late spend() would be
    # lost, so it raises.
    with pytest.raises(RuntimeError, match="settled already"):
        huge.spend(1)


def test_a_failed_settle_on_exit_raises_nothing_and_is_kept(rk, client, user, caplog):
    """Work that outlived its reservation's TTL: the settle on exit fails
    (NOT_FOUND), which neither raises from a block that succeeded nor hides
    the exception of one that failed; the error is kept and logged."""
    with pytest.raises(RuntimeError, match="the block's"):
        with client.budget(DOMAIN, user, estimate=100, ttl=1) as failed:
            with client.budget(DOMAIN, user, estimate=100, ttl=1) as done:
                time.sleep(1.6)
                done.spend(10)
            raise RuntimeError("the block's own failure")
    for b in (done, failed):
        assert isinstance(b.settle_error, rk.ReservationNotFound) and b.settlement is None
    assert str(done.settle_error).count("reservation not found") == 1, str(done.settle_error)
    assert "stays charged at its estimate" in caplog.text
    # Both stay charged at their estimates.
    assert client.reserve(DOMAIN, user, estimate=1).statuses[0].remaining == BUDGET - 200 - 1


def test_an_estimate_no_limit_admits_is_refused_for_good(rk, client, user):
    """More than the limit at once: refused, with no retry_after to wait for."""
    with pytest.raises(rk.BudgetExceeded) as refused:
        with client.budget(DOMAIN, user, estimate=BUDGET + 1):
            pytest.fail("the block ran without a reservation")
    assert refused.value.retry_after is None and refused.value.statuses[0].over
    assert "retrying will not help" in str(refused.value)
    # The budget is untouched: all of it still fits.
    assert client.reserve(DOMAIN, user, estimate=BUDGET).granted


class _CountSettles(grpc.UnaryUnaryClientInterceptor):
    def __init__(self):
        self.settles = 0

    def intercept_unary_unary(self, continuation, details, request):
        if details.method.endswith("/Settle"):
            self.settles += 1
        return continuation(details, request)


def test_settle_is_made_again_while_the_service_is_unavailable(rk):
    count = _CountSettles()
    channel = grpc.intercept_channel(grpc.insecure_channel("127.0.0.1:1"), count)
    down = rk.RateLimitClient(channel=channel, timeout=0.5)
    with pytest.raises(grpc.RpcError) as e:
        down.settle("r1.anything", 5)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert count.settles == 3, "three calls in all"
    with pytest.raises(grpc.RpcError):
        down.settle("r1.anything", 5, attempts=1)
    assert count.settles == 4
    channel.close()


def test_settle_of_an_expired_reservation_is_not_found(rk, client, user):
    """Never settled within its TTL: the reservation is gone, and its
    estimate stays charged."""
    r = client.reserve(DOMAIN, user, estimate=200, ttl=1)
    assert r.granted and r.ttl == timedelta(seconds=1)
    time.sleep(1.6)
    with pytest.raises(rk.ReservationNotFound) as e:
        client.settle(r.reservation_id, 10)
    assert e.value.reservation_id == r.reservation_id
    assert "reservation not found" in str(e.value)
    still = client.reserve(DOMAIN, user, estimate=1)
    assert still.statuses[0].remaining == BUDGET - 200 - 1


def test_unlimited_descriptors_reserve_nothing(client):
    r = client.reserve(DOMAIN, [{"plan": "internal"}], estimate=10**6)
    assert r.granted and r.reservation_id == ""
    assert r.statuses[0].limit == 0
    # Nothing to settle: answered without a call.
    assert client.settle(r.reservation_id, 5).settled == 5


def test_bad_requests(rk, client, user):
    with pytest.raises(ValueError):
        client.reserve(DOMAIN, user, estimate=0)
    with pytest.raises(ValueError):
        client.settle("x", -1)
    with pytest.raises(grpc.RpcError) as e:
        client.reserve(DOMAIN, user, estimate=10, ttl=timedelta(hours=2))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()
    with pytest.raises(grpc.RpcError) as e:
        client.settle("not-a-reservation-id", 1)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and e.value.details()


def test_fail_open_grants_when_unreachable(rk):
    with rk.RateLimitClient("127.0.0.1:1", timeout=0.5, fail_open=True) as down:
        r = down.reserve(DOMAIN, [{"user_id": "anyone"}], estimate=10)
        assert r.granted and r.reservation_id == "" and r.error.startswith("UNAVAILABLE")
        with down.budget(DOMAIN, [{"user_id": "anyone"}], estimate=10) as b:
            b.spend(3)
        # Nothing was reserved, so nothing is settled: said so, without a call.
        assert b.settlement.settled == 0 and b.settlement.error.startswith("UNAVAILABLE")
        assert b.settle_error is None
    with rk.RateLimitClient("127.0.0.1:1", timeout=0.5) as down:
        with pytest.raises(grpc.RpcError) as e:
            down.reserve(DOMAIN, [{"user_id": "anyone"}], estimate=10)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
