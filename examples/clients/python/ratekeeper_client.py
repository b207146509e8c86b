"""A small Python client for ratekeeper's ShouldRateLimit (Envoy's rate limit API v3).

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
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Iterable, Mapping, Optional, Sequence, Tuple, Union

import grpc

__all__ = [
    "Decision",
    "DescriptorStatus",
    "Limit",
    "RateLimitClient",
    "generate_stubs",
]

# examples/clients/python/ -> the repository's proto/.
DEFAULT_PROTO_DIR = Path(__file__).resolve().parents[3] / "proto"

Descriptor = Union[Mapping[str, str], Sequence[Tuple[str, str]]]

# Errors that mean "no answer from the service" rather than "bad request":
# with fail_open these allow the call, as Envoy's failure_mode_deny: false does.
_UNAVAILABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def generate_stubs(out_dir: Union[str, Path], proto_dir: Union[str, Path] = DEFAULT_PROTO_DIR) -> Path:
    """Generates the Python messages and gRPC stubs for every .proto under
    proto_dir into out_dir with grpcio-tools, and puts out_dir on sys.path."""
    from grpc_tools import protoc  # grpcio-tools, needed only here

    proto_dir = Path(proto_dir).resolve()
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
        """When a refused request may succeed: the longest reset of the refusing descriptors."""
        resets = [s.reset_after for s in self.statuses if s.over_limit and s.reset_after is not None]
        return max(resets) if resets else None


class RateLimitClient:
    """ShouldRateLimit over one gRPC channel (HTTP/2, reused for every call).

    target: "host:port". timeout: seconds per call. fail_open: when the service
    is unreachable or misses the deadline, answer allowed (with `error` set)
    instead of raising grpc.RpcError. channel: an existing channel (e.g. with
    TLS); options: grpc channel options for the channel made here.
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

    def should_rate_limit(self, domain: str, descriptors: Iterable[Descriptor], hits_addend: int = 1) -> Decision:
        """Asks whether a request carrying `descriptors` in `domain` may go ahead,
        counting hits_addend hits (default 1). hits_addend=0 checks without
        counting: on the wire a request-level 0 means "unset" (counted as 1),
        so it is sent as each descriptor's own hits_addend (UInt64Value 0)."""
        if hits_addend < 0:
            raise ValueError("hits_addend must be >= 0")
        pb2 = self._pb2
        request = pb2.RateLimitRequest(domain=domain, hits_addend=hits_addend)
        for d in descriptors:
            entries = d.items() if isinstance(d, Mapping) else d
            desc = request.descriptors.add()
            for key, value in entries:
                desc.entries.add(key=key, value=value)
            if hits_addend == 0:
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
            reset = s.duration_until_reset.ToTimedelta() if s.HasField("duration_until_reset") else None
            statuses.append(DescriptorStatus(codes.Name(s.code), limit, s.limit_remaining, reset))
        return Decision(allowed=response.overall_code != codes.OVER_LIMIT, statuses=tuple(statuses))

    def close(self) -> None:
        if self._own_channel:
            self.channel.close()

    def __enter__(self) -> "RateLimitClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


if __name__ == "__main__":
    # python ratekeeper_client.py [TARGET] [DOMAIN] [key=value ...]
    import tempfile

    target = sys.argv[1] if len(sys.argv) > 1 else "localhost:8081"
    domain = sys.argv[2] if len(sys.argv) > 2 else "api"
    pairs = [tuple(a.split("=", 1)) for a in sys.argv[3:]] or [("remote_address", "127.0.0.1")]
    generate_stubs(tempfile.mkdtemp(prefix="ratekeeper-stubs-"))
    with RateLimitClient(target) as client:
        print(client.should_rate_limit(domain, [pairs]))
