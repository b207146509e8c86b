"""A small Python client for ratekeeper: ShouldRateLimit (Envoy's rate limit
API v3), concurrency leases (ratekeeper.v1.ConcurrencyService) and cost
budgets spent in two steps (ratekeeper.v1.BudgetService).

It uses grpcio with stubs that grpcio-tools generates from the repository's
`proto/` directory (nothing generated is committed):

    from ratekeeper_client import RateLimitClient, generate_stubs
    generate_stubs("gen")            # once; puts gen/ on sys.path
    with RateLimitClient("localhost:8081") as rl:
        d = rl.should_rate_limit("api", [{"plan": "free", "user_id": "alice"}])
        if not d.allowed:
            print("retry in", d.retry_after)

A descriptor is a dict (entries in insertion order) or a sequence of
(key, value) pairs; the order of entries is the order of the limits file's
nesting (`plan` then `user_id` above).

Concurrency leases ("at most N open connections per user", the limits file's
`concurrency:` rules):

    with RateLimitClient("localhost:8081") as rl:
        lease = rl.acquire_connection("ws", [{"user_id": "alice"}])
        if lease.granted:
            ...                                  # heartbeat well within lease.lease_ttl
            rl.heartbeat([lease.lease_id])
            rl.release([lease.lease_id])
        # or let the server keep the lease alive while a Hold stream is open:
        with rl.hold("ws", [{"user_id": "alice"}]) as lease:
            if lease.granted:
                ...                              # released when the block ends

Budgets for work whose cost is known only when it ends but bounded before it
starts (an LLM call's tokens): reserve the most it can cost, settle at what
it cost:

    with RateLimitClient("localhost:8081") as rl:
        try:
            with rl.budget("llm", [{"user_id": "alice"}], estimate=512) as b:
                usage = call_the_model(max_tokens=512)
                b.spend(usage.total_tokens)      # settled at this on exit
        except BudgetExceeded as e:
            print("429, retry after", e.retry_after)
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Optional, Sequence, Tuple, Union

import grpc

__all__ = [
    "Budget",
    "BudgetExceeded",
    "BudgetStatus",
    "Decision",
    "DescriptorStatus",
    "HeartbeatResult",
    "Lease",
    "Limit",
    "RateLimitClient",
    "Reservation",
    "ReservationNotFound",
    "Settlement",
    "generate_stubs",
    "load_stubs",
]

# The most hits one call may carry: a Reserve's estimate, a Settle's actual.
MAX_HITS = 2**32

_log = logging.getLogger("ratekeeper_client")

Descriptor = Union[Mapping[str, str], Sequence[Tuple[str, str]]]

# Errors that mean "no answer from the service" rather than "bad request":
# with fail_open these allow the call, as Envoy's failure_mode_deny: false does.
# CANCELLED too: this client cancels no unary call itself, and the server
# (tonic) answers a call whose deadline passed first there CANCELLED, where
# grpc-go answers DEADLINE_EXCEEDED (README, "Differences").
_UNAVAILABLE = (
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.CANCELLED,
)


def _repository_protos() -> Path:
    """The repository's proto/, when this file is still in
    examples/clients/python/ of a checkout."""
    here = Path(__file__).resolve()
    proto_dir = here.parents[3] / "proto" if len(here.parents) > 3 else None
    if proto_dir is None or not (proto_dir / "ratekeeper" / "v1" / "budget.proto").is_file():
        raise FileNotFoundError(
            "this file is not in a ratekeeper checkout: pass generate_stubs(DIR, proto_dir=...) "
            "the repository's proto/ directory"
        )
    return proto_dir


def generate_stubs(out_dir: Union[str, Path], proto_dir: Union[str, Path, None] = None) -> Path:
    """Generates the Python messages and gRPC stubs for every .proto under
    proto_dir (default: the repository's proto/, when this file is in a
    checkout) into out_dir with grpcio-tools, and puts out_dir on sys.path."""
    from grpc_tools import protoc  # grpcio-tools, needed only here

    proto_dir = Path(proto_dir).resolve() if proto_dir is not None else _repository_protos()
    out_dir = Path(out_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    well_known = Path(protoc.__file__).resolve().parent / "_proto"  # google/protobuf/*.proto
    protos = sorted(str(p.relative_to(proto_dir)) for p in proto_dir.rglob("*.proto"))
    if not protos:
        raise FileNotFoundError(f"no .proto files under {proto_dir}")
    args = [
        "grpc_tools.protoc",
        f"-I{proto_dir}",
        f"-I{well_known}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"grpc_tools.protoc failed for {proto_dir}")
    if str(out_dir) not in sys.path:
        sys.path.insert(0, str(out_dir))
    importlib.invalidate_caches()
    return out_dir


def load_stubs(proto_dir: Union[str, Path, None] = None) -> None:
    """Generates the stubs (as generate_stubs) into a temporary directory,
    imports every module this client uses, and removes the directory: for a
    program that compiles them at start and leaves nothing behind."""
    import shutil
    import tempfile

    out_dir = Path(tempfile.mkdtemp(prefix="ratekeeper-stubs-")).resolve()
    try:
        generate_stubs(out_dir, proto_dir)
        _stubs()
        for name in ("concurrency", "budget"):
            _v1_stubs(name)
    finally:
        if str(out_dir) in sys.path:  # as generate_stubs put it there
            sys.path.remove(str(out_dir))
        shutil.rmtree(out_dir, ignore_errors=True)


def _stubs():
    """The generated modules (imported on first use, after generate_stubs)."""
    try:
        from envoy.service.ratelimit.v3 import rls_pb2, rls_pb2_grpc
    except ImportError as e:
        raise ImportError(
            "ratekeeper stubs not found: call ratekeeper_client.generate_stubs(DIR) "
            "or put the grpcio-tools output directory on PYTHONPATH"
        ) from e
    return rls_pb2, rls_pb2_grpc


def _v1_stubs(name: str):
    """The generated ratekeeper.v1 modules of proto/ratekeeper/v1/NAME.proto
    (`concurrency`: leases, `budget`: reserve and settle)."""
    try:
        pb2 = importlib.import_module(f"ratekeeper.v1.{name}_pb2")
        pb2_grpc = importlib.import_module(f"ratekeeper.v1.{name}_pb2_grpc")
    except ImportError as e:
        raise ImportError(
            "ratekeeper.v1 stubs not found: call ratekeeper_client.generate_stubs(DIR) "
            f"(it compiles proto/ratekeeper/v1/{name}.proto too) or put the "
            "grpcio-tools output directory on PYTHONPATH"
        ) from e
    return pb2, pb2_grpc


def _entries(descriptor: Descriptor):
    return descriptor.items() if isinstance(descriptor, Mapping) else descriptor


def _add_descriptors(field, descriptors: Iterable[Descriptor]) -> None:
    """Appends descriptors to a request's repeated descriptor field (Envoy's
    RateLimitDescriptor and ratekeeper.v1's Descriptor both hold `entries`)."""
    for d in descriptors:
        desc = field.add()
        for key, value in _entries(d):
            desc.entries.add(key=key, value=value)


def _as_timedelta(value: Union[float, timedelta]) -> timedelta:
    return value if isinstance(value, timedelta) else timedelta(seconds=value)


def _optional_duration(message, name: str) -> Optional[timedelta]:
    return getattr(message, name).ToTimedelta() if message.HasField(name) else None


@dataclass(frozen=True)
class Limit:
    """The rule that applied: requests_per_unit per unit (SECOND ... YEAR)."""

    requests_per_unit: int
    unit: str
    name: str = ""


@dataclass(frozen=True)
class DescriptorStatus:
    """The answer for one descriptor, in request order."""

    code: str  # "OK" or "OVER_LIMIT"
    limit: Optional[Limit]  # None: no rule matched (allowed, not counted)
    remaining: int  # limit_remaining
    reset_after: Optional[timedelta]  # duration_until_reset (None without a limit)

    @property
    def over_limit(self) -> bool:
        return self.code == "OVER_LIMIT"


@dataclass(frozen=True)
class Decision:
    """The answer for one request: allowed is False when any descriptor is over its limit."""

    allowed: bool
    statuses: Tuple[DescriptorStatus, ...] = field(default_factory=tuple)
    # Set when fail_open allowed the call because the service did not answer.
    error: Optional[str] = None

    @property
    def retry_after(self) -> Optional[timedelta]:
        """When a refused request may succeed: the longest reset of the refusing descriptors.

        A request of more hits than a limit admits at once can never
        succeed: the service then tells the longest wait the limit has, and
        0 once it is fully restored (README, "A request that can never
        fit"), so a caller whose hits_addend is over a refusing status's
        limit.requests_per_unit (a bucket's burst) must not retry it.
        """
        resets = [s.reset_after for s in self.statuses if s.over_limit and s.reset_after is not None]
        return max(resets) if resets else None


@dataclass(frozen=True)
class Lease:
    """The answer to AcquireConnection (or a Hold stream's first event).

    granted: the connection may stay open. lease_id: heartbeat and release
    it; empty when refused, and also when granted because no `concurrency:`
    rule matched (then limit is 0 and there is nothing to give back).
    active: leases open on the tightest limited descriptor, this one
    included when granted; limit: that descriptor's max_connections.
    retry_after: when refused, the soonest an existing lease expires unless
    it is renewed (a release frees a place sooner). lease_ttl: heartbeat well
    within it. error: set only when fail_open granted a call the service did
    not answer.
    """

    granted: bool
    lease_id: str = ""
    active: int = 0
    limit: int = 0
    retry_after: Optional[timedelta] = None
    lease_ttl: Optional[timedelta] = None
    error: Optional[str] = None


@dataclass(frozen=True)
class BudgetStatus:
    """One descriptor's standing after a reserve or settle: remaining hits
    of its tightest limit, that limit's requests_per_unit (both 0 when no
    rule limits the descriptor), and whether it refused the reservation."""

    remaining: int
    limit: int
    over: bool = False


@dataclass(frozen=True)
class Reservation:
    """The answer to reserve().

    granted: the estimate was taken from every limit of the descriptors'
    rules (or, refused, from none). reservation_id: settle it; empty when
    refused, and also when granted because no rule limits the descriptors
    (nothing to settle). statuses: one BudgetStatus per descriptor, in
    order. retry_after: when refused, how long until the estimate would fit.
    ttl: settle within it; a reservation never settled stays charged at its
    estimate. wait: when granted on a leaky_bucket limit, how long until the
    reservation's turn in its queue (start the work after it; 0: now);
    None otherwise. error: set only when fail_open granted a call the
    service did not answer.
    """

    granted: bool
    reservation_id: str = ""
    statuses: Tuple[BudgetStatus, ...] = ()
    retry_after: Optional[timedelta] = None
    ttl: Optional[timedelta] = None
    error: Optional[str] = None
    wait: Optional[timedelta] = None


@dataclass(frozen=True)
class Settlement:
    """The answer to settle(): the cost the reservation is settled at (for
    a retried settle, the first settle's), whether an earlier settle had
    already settled it (this one charged nothing), and one BudgetStatus per
    descriptor of the reserve, after the settlement."""

    settled: int
    already_settled: bool = False
    statuses: Tuple[BudgetStatus, ...] = ()
    # Set only when budget() ran on a reservation fail_open granted without
    # the service: nothing was reserved, and nothing is settled (settled 0).
    error: Optional[str] = None


class BudgetExceeded(Exception):
    """Raised by budget() when the reservation is refused; retry_after says
    how long until the estimate would fit, or is None when it never will
    (the estimate is more than a limit admits at once: retrying cannot
    help; an LLM gateway answers such a max_tokens with a 400)."""

    def __init__(self, reservation: Reservation):
        self.reservation = reservation
        self.retry_after = reservation.retry_after
        self.statuses = reservation.statuses
        if self.retry_after is None:
            why = "the estimate is more than the limit admits at once; retrying will not help"
        else:
            why = f"retry after {self.retry_after}"
        super().__init__(f"budget exceeded; {why}")


class ReservationNotFound(LookupError):
    """settle() of a reservation the service does not know: it expired (its
    estimate stays charged), was never granted, or the id was altered."""

    def __init__(self, reservation_id: str, details: str):
        self.reservation_id = reservation_id
        # The service's message already says "reservation not found: ...".
        prefix = "" if details.startswith("reservation not found") else "reservation not found: "
        super().__init__(f"{prefix}{details}")


class Budget:
    """A granted reservation being spent, as budget() yields it: report what
    the work cost with spend(n) (more than once adds up); on exit it is
    settled at the total."""

    def __init__(self, reservation: Reservation, estimate: int):
        self.reservation = reservation
        self.estimate = estimate
        self.spent: Optional[int] = None  # None until spend() is called
        self.settlement: Optional[Settlement] = None
        # A settle that failed on exit from a block that raised.
        self.settle_error: Optional[Exception] = None
        # Set once the block has exited: the settle has been made.
        self.closed = False

    def spend(self, n: int) -> None:
        # Checked here, inside the block, so that a bad value fails where it
        # is made, not in the settle on exit.
        if self.closed:
            raise RuntimeError("spend() after the budget() block: its reservation is settled already")
        if not isinstance(n, int) or isinstance(n, bool):
            raise TypeError(f"spend(n) needs a whole number of hits, not {n!r}")
        if n < 0:
            raise ValueError("spend(n) needs n >= 0")
        total = (self.spent or 0) + n
        if total > MAX_HITS:
            raise ValueError(f"spend(n): {total} hits in all, more than a settle takes (2^32)")
        self.spent = total


@dataclass(frozen=True)
class HeartbeatResult:
    """extended: leases renewed for their TTL. lost: leases that expired or
    were released; their connections should close."""

    extended: Tuple[str, ...] = ()
    lost: Tuple[str, ...] = ()


def _budget_statuses(statuses) -> Tuple[BudgetStatus, ...]:
    return tuple(BudgetStatus(s.remaining, s.limit, s.over) for s in statuses)


class RateLimitClient:
    """ShouldRateLimit, the concurrency lease calls and the budget calls over
    one gRPC channel (HTTP/2, reused for every call).

    target: "host:port". timeout: seconds per call. fail_open: when the service
    is unreachable or misses the deadline, answer allowed (with `error` set)
    instead of raising grpc.RpcError. channel: an existing channel (e.g. with
    TLS); options: grpc channel options for the channel made here. fail_open
    applies to ShouldRateLimit, acquire_connection, hold and reserve (and so
    budget); heartbeat, release and settle always raise.
    """

    def __init__(
        self,
        target: str = "localhost:8081",
        *,
        timeout: float = 0.5,
        fail_open: bool = False,
        channel: Optional[grpc.Channel] = None,
        options: Sequence[Tuple[str, object]] = (),
    ):
        self._pb2, rls_pb2_grpc = _stubs()
        self._own_channel = channel is None
        self.channel = channel or grpc.insecure_channel(target, options=list(options))
        self._stub = rls_pb2_grpc.RateLimitServiceStub(self.channel)
        self.timeout = timeout
        self.fail_open = fail_open
        self._leases = None  # (concurrency_pb2, stub), made on first use
        self._budgets = None  # (budget_pb2, stub), made on first use

    def should_rate_limit(self, domain: str, descriptors: Iterable[Descriptor], hits_addend: int = 1) -> Decision:
        """Asks whether a request carrying `descriptors` in `domain` may go ahead,
        counting hits_addend hits (default 1). hits_addend=0 checks without
        counting: on the wire a request-level 0 means "unset" (counted as 1),
        so it is sent as each descriptor's own hits_addend (UInt64Value 0)."""
        if hits_addend < 0:
            raise ValueError("hits_addend must be >= 0")
        pb2 = self._pb2
        request = pb2.RateLimitRequest(domain=domain, hits_addend=hits_addend)
        _add_descriptors(request.descriptors, descriptors)
        if hits_addend == 0:
            for desc in request.descriptors:
                desc.hits_addend.value = 0
                desc.hits_addend.SetInParent()  # present, with value 0
        try:
            response = self._stub.ShouldRateLimit(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if self.fail_open and e.code() in _UNAVAILABLE:
                return Decision(allowed=True, error=f"{e.code().name}: {e.details()}")
            raise
        return self._decision(response)

    def _decision(self, response) -> Decision:
        pb2 = self._pb2
        codes = pb2.RateLimitResponse.Code
        units = pb2.RateLimitResponse.RateLimit.Unit
        statuses = []
        for s in response.statuses:
            limit = None
            if s.HasField("current_limit"):
                cl = s.current_limit
                limit = Limit(cl.requests_per_unit, units.Name(cl.unit), cl.name)
            reset = _optional_duration(s, "duration_until_reset")
            statuses.append(DescriptorStatus(codes.Name(s.code), limit, s.limit_remaining, reset))
        return Decision(allowed=response.overall_code != codes.OVER_LIMIT, statuses=tuple(statuses))

    # Concurrency leases: ratekeeper.v1.ConcurrencyService.

    def _lease_api(self):
        if self._leases is None:
            pb2, pb2_grpc = _v1_stubs("concurrency")
            self._leases = (pb2, pb2_grpc.ConcurrencyServiceStub(self.channel))
        return self._leases

    def _acquire_request(self, domain, descriptors, lease_ttl, holder):
        pb2, _ = self._lease_api()
        request = pb2.AcquireRequest(domain=domain, holder=holder)
        _add_descriptors(request.descriptors, descriptors)
        if lease_ttl is not None:
            request.lease_ttl.FromTimedelta(_as_timedelta(lease_ttl))
        return request

    @staticmethod
    def _lease(response) -> Lease:
        return Lease(
            granted=response.granted,
            lease_id=response.lease_id,
            active=response.active,
            limit=response.limit,
            retry_after=_optional_duration(response, "retry_after"),
            lease_ttl=_optional_duration(response, "lease_ttl"),
        )

    def acquire_connection(
        self,
        domain: str,
        descriptors: Iterable[Descriptor],
        lease_ttl: Union[None, float, timedelta] = None,
        holder: str = "",
    ) -> Lease:
        """Takes a lease on every descriptor limited by the domain's
        `concurrency:` rules, or on none (refused). lease_ttl (seconds or a
        timedelta, 1 s to 1 h) overrides the rule's; holder is free text for
        the server's logs. Keep the lease with heartbeat() well within
        lease.lease_ttl, and release() it when the connection ends."""
        _, stub = self._lease_api()
        request = self._acquire_request(domain, descriptors, lease_ttl, holder)
        try:
            response = stub.AcquireConnection(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if self.fail_open and e.code() in _UNAVAILABLE:
                return Lease(granted=True, error=f"{e.code().name}: {e.details()}")
            raise
        return self._lease(response)

    def heartbeat(self, lease_ids: Iterable[str]) -> HeartbeatResult:
        """Extends the leases that still exist by their TTL; says which are
        lost (expired or released). Empty ids (leases of unlimited
        connections) are skipped. At most 1000 ids per call."""
        pb2, stub = self._lease_api()
        ids = [i for i in lease_ids if i]
        if not ids:
            return HeartbeatResult()
        response = stub.Heartbeat(pb2.HeartbeatRequest(lease_ids=ids), timeout=self.timeout)
        return HeartbeatResult(tuple(response.extended), tuple(response.lost))

    def release(self, lease_ids: Iterable[str]) -> None:
        """Gives leases back; releasing one twice, or one already expired, is
        not an error. Empty ids are skipped."""
        pb2, stub = self._lease_api()
        ids = [i for i in lease_ids if i]
        if ids:
            stub.Release(pb2.ReleaseRequest(lease_ids=ids), timeout=self.timeout)

    @contextlib.contextmanager
    def hold(
        self,
        domain: str,
        descriptors: Iterable[Descriptor],
        lease_ttl: Union[None, float, timedelta] = None,
        holder: str = "",
        on_lost: Optional[Callable[[str], None]] = None,
    ) -> Iterator[Lease]:
        """Opens a Hold stream and yields its first event as a Lease (granted
        or refused). While the block runs the server keeps a granted lease
        alive; on exit the stream is cancelled, which releases it at once (no
        heartbeat or release call needed). If the server reports the lease
        lost while the block runs, or the stream ends (the replica stopped or
        went away), on_lost(lease_id) is called from a background thread:
        the connection it guarded should close."""
        _, stub = self._lease_api()
        request = self._acquire_request(domain, descriptors, lease_ttl, holder)
        call = stub.Hold(request)  # long-lived: no deadline
        exited = threading.Event()  # set before the block's exit cancels the call
        try:
            try:
                first = next(call)
            except StopIteration:
                raise RuntimeError("the Hold stream ended before its first event") from None
            except grpc.RpcError as e:
                if not (self.fail_open and e.code() in _UNAVAILABLE):
                    raise
                lease = Lease(granted=True, error=f"{e.code().name}: {e.details()}")
            else:
                lease = self._lease(first.acquired)
                if lease.granted and lease.lease_id and on_lost is not None:
                    watch = (call, lease.lease_id, on_lost, exited)
                    threading.Thread(target=self._watch_hold, args=watch, daemon=True).start()
            yield lease
        finally:
            exited.set()
            call.cancel()

    @staticmethod
    def _watch_hold(call, lease_id: str, on_lost: Callable[[str], None], exited: threading.Event) -> None:
        """Calls on_lost(lease_id) when the stream says the lease is lost, or
        ends for any reason but the block's own exit: a replica stopping
        releases the leases it holds (UNAVAILABLE), one gone away lets them
        lapse, a proxy resetting the stream (CANCELLED) leaves it to lapse,
        and either way nothing keeps the lease any more."""
        try:
            for event in call:
                if event.WhichOneof("event") == "lost":
                    on_lost(lease_id)
                    return
        except grpc.RpcError:
            pass
        if not exited.is_set():
            on_lost(lease_id)

    # Budgets: ratekeeper.v1.BudgetService (reserve, then settle).

    def _budget_api(self):
        if self._budgets is None:
            pb2, pb2_grpc = _v1_stubs("budget")
            self._budgets = (pb2, pb2_grpc.BudgetServiceStub(self.channel))
        return self._budgets

    def reserve(
        self,
        domain: str,
        descriptors: Iterable[Descriptor],
        estimate: int,
        ttl: Union[None, float, timedelta] = None,
    ) -> Reservation:
        """Takes `estimate` hits (the most the work can cost, > 0) from every
        limit of the descriptors' rate limit rules, or none (refused). ttl
        (seconds or a timedelta, 1 s to 1 h; the service's default is 5
        minutes): how long the reservation can be settled."""
        if not 0 < estimate <= MAX_HITS:
            raise ValueError("estimate must be > 0 and at most 2^32")
        pb2, stub = self._budget_api()
        request = pb2.ReserveRequest(domain=domain, estimate=estimate)
        _add_descriptors(request.descriptors, descriptors)
        if ttl is not None:
            request.ttl.FromTimedelta(_as_timedelta(ttl))
        try:
            response = stub.Reserve(request, timeout=self.timeout)
        except grpc.RpcError as e:
            if self.fail_open and e.code() in _UNAVAILABLE:
                return Reservation(granted=True, error=f"{e.code().name}: {e.details()}")
            raise
        return Reservation(
            granted=response.granted,
            reservation_id=response.reservation_id,
            statuses=_budget_statuses(response.statuses),
            retry_after=_optional_duration(response, "retry_after"),
            ttl=_optional_duration(response, "ttl"),
            wait=_optional_duration(response, "wait"),
        )

    def settle(self, reservation_id: str, actual: int, attempts: int = 3) -> Settlement:
        """Makes the reservation's charge `actual` (0 gives the whole estimate
        back; more than the estimate is charged after the fact). A call that
        fails UNAVAILABLE or DEADLINE_EXCEEDED is made again, up to
        `attempts` calls in all: a reservation settles once, so a repeat of a
        Settle that did reach the service answers already_settled with its
        `settled`. An empty id (nothing was limited) settles at once without
        a call. Raises ReservationNotFound when the service does not know the
        id, grpc.RpcError otherwise, whatever fail_open says."""
        if not 0 <= actual <= MAX_HITS:
            raise ValueError("actual must be >= 0 and at most 2^32")
        if not reservation_id:
            return Settlement(settled=actual)
        pb2, stub = self._budget_api()
        request = pb2.SettleRequest(reservation_id=reservation_id, actual=actual)
        for attempt in range(1, max(attempts, 1) + 1):
            try:
                response = stub.Settle(request, timeout=self.timeout)
                break
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    raise ReservationNotFound(reservation_id, e.details()) from e
                if attempt >= attempts or e.code() not in _UNAVAILABLE:
                    raise
                time.sleep(0.05 * 2**attempt)
        return Settlement(
            settled=response.settled,
            already_settled=response.already_settled,
            statuses=_budget_statuses(response.statuses),
        )

    @contextlib.contextmanager
    def budget(
        self,
        domain: str,
        descriptors: Iterable[Descriptor],
        estimate: int,
        ttl: Union[None, float, timedelta] = None,
    ) -> Iterator[Budget]:
        """Reserves `estimate` on entering (raises BudgetExceeded, carrying
        retry_after, when refused) and yields a Budget; report the work's
        cost with budget.spend(n). On exit the reservation is settled at what
        was spent. If nothing was spent when the block raised, it is settled
        at the estimate: the work may have cost anything up to it, and
        charging the most it could have cost keeps the budget safe (call
        spend(0) first if a failure is known to have cost nothing). A block
        that ends without spend() is settled at the estimate as well.

        A settle that fails on exit (the reservation outlived its TTL, the
        service stayed unreachable) raises nothing: the work is done, and
        the reservation stays charged at its estimate, the side that keeps
        the budget: its estimate counts as the work's cost, and ages out
        as the limit's hits do (a daily window's at the day's end), not at
        the reservation's TTL, which only bounds when a settle may still
        change it. The error is kept in
        budget.settle_error (budget.settlement is then None) and logged as
        a warning. With fail_open, a reservation granted without the
        service is settled without it: Settlement(settled=0, error=...)."""
        reservation = self.reserve(domain, descriptors, estimate, ttl)
        if not reservation.granted:
            raise BudgetExceeded(reservation)
        spending = Budget(reservation, estimate)
        try:
            yield spending
        finally:
            spending.closed = True
            actual = estimate if spending.spent is None else spending.spent
            if reservation.error is not None:
                spending.settlement = Settlement(settled=0, error=reservation.error)
            else:
                try:
                    spending.settlement = self.settle(reservation.reservation_id, actual)
                except Exception as e:  # noqa: BLE001 (kept and logged, see above)
                    spending.settle_error = e
                    _log.warning("settling %s at %d failed; it stays charged at its estimate (%d): %s",
                                 reservation.reservation_id, actual, estimate, e)

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> "RateLimitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    # python ratekeeper_client.py [TARGET] [DOMAIN] [key=value ...]
    target = sys.argv[1] if len(sys.argv) > 1 else "localhost:8081"
    domain = sys.argv[2] if len(sys.argv) > 2 else "api"
    pairs = [tuple(a.split("=", 1)) for a in sys.argv[3:]] or [("remote_address", "127.0.0.1")]
    load_stubs()
    with RateLimitClient(target) as client:
        print(client.should_rate_limit(domain, [pairs]))
