"""A minimal Envoy RLS v3 client: plain grpcio carrying Envoy's own messages.

The messages come from envoy-data-plane (betterproto2 classes generated from
Envoy's protos), so these tests speak exactly what Envoy sends, without any
code generated from this repository's protos.
"""
from __future__ import annotations

import time

import grpc
from envoy_data_plane.envoy.extensions.common.ratelimit.v3 import (
    RateLimitDescriptor,
    RateLimitDescriptorEntry,
    RateLimitDescriptorRateLimitOverride,
)
from envoy_data_plane.envoy.service.ratelimit.v3 import (
    RateLimitRequest,
    RateLimitResponse,
    RateLimitResponseCode,  # overall_code and statuses[i].code
    RateLimitResponseRateLimitUnit,  # current_limit.unit (has WEEK)
)
from envoy_data_plane.envoy.type.v3 import RateLimitUnit  # override unit (no WEEK)

__all__ = [
    "METHOD",
    "RateLimitDescriptor",
    "RateLimitDescriptorEntry",
    "RateLimitDescriptorRateLimitOverride",
    "RateLimitRequest",
    "RateLimitResponse",
    "RateLimitResponseCode",
    "RateLimitResponseRateLimitUnit",
    "RateLimitUnit",
    "RlsClient",
    "descriptor",
    "insecure_channel",
    "wait_for_fresh_window",
]

METHOD = "/envoy.service.ratelimit.v3.RateLimitService/ShouldRateLimit"

# Never route loopback test traffic through a proxy from the environment.
CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def insecure_channel(target: str) -> grpc.Channel:
    return grpc.insecure_channel(target, options=CHANNEL_OPTIONS)


def descriptor(entries, hits_addend=None, limit=None) -> RateLimitDescriptor:
    """A descriptor from (key, value) pairs or a dict.

    hits_addend: None leaves the UInt64Value wrapper absent; 0 sends it with 0.
    limit: (requests_per_unit, RateLimitUnit | int) for the `limit` override.
    """
    if isinstance(entries, dict):
        entries = list(entries.items())
    d = RateLimitDescriptor(
        entries=[RateLimitDescriptorEntry(key=k, value=v) for k, v in entries],
        hits_addend=hits_addend,
    )
    if limit is not None:
        rpu, unit = limit
        d.limit = RateLimitDescriptorRateLimitOverride(requests_per_unit=rpu, unit=RateLimitUnit(unit))
    return d


class RlsClient:
    """`ShouldRateLimit` over one channel."""

    def __init__(self, target: str, channel=None):
        # A given channel (e.g. a secure one) is used as is.
        self.channel = channel if channel is not None else insecure_channel(target)
        self._call = self.channel.unary_unary(
            METHOD,
            request_serializer=bytes,  # betterproto2: bytes(msg) is the wire form
            response_deserializer=RateLimitResponse.parse,
        )

    def should_rate_limit(self, domain, descriptors, hits_addend=0, timeout=5.0) -> RateLimitResponse:
        """descriptors: RateLimitDescriptor objects, dicts or (key, value) lists.
        hits_addend: the request-level uint32 (0 = unset, the server counts 1)."""
        descs = [d if isinstance(d, RateLimitDescriptor) else descriptor(d) for d in descriptors]
        request = RateLimitRequest(domain=domain, descriptors=descs, hits_addend=hits_addend)
        return self._call(request, timeout=timeout)

    def close(self):
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for_fresh_window(period_s: int, margin_s: float = 3.0) -> None:
    """Windows are aligned to the Unix epoch: if the current one of `period_s`
    ends within `margin_s`, sleep into the next so a test's hits share a window."""
    left = period_s - (time.time() % period_s)
    if left < margin_s:
        time.sleep(left + 0.05)


def summarize(resp: RateLimitResponse) -> dict:
    """A plain-dict view of a response, for assertion messages and debugging."""
    out = {"overall_code": resp.overall_code.name, "statuses": []}
    for s in resp.statuses:
        cl = s.current_limit
        out["statuses"].append(
            {
                "code": s.code.name,
                "current_limit": None
                if cl is None
                else {"requests_per_unit": cl.requests_per_unit, "unit": cl.unit.name, "name": cl.name},
                "limit_remaining": s.limit_remaining,
                "duration_until_reset_s": None
                if s.duration_until_reset is None
                else s.duration_until_reset.total_seconds(),
            }
        )
    return out


if __name__ == "__main__":
    import json
    import sys

    target = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:8081"
    domain = sys.argv[2] if len(sys.argv) > 2 else "test"
    with RlsClient(target) as client:
        print(json.dumps(summarize(client.should_rate_limit(domain, [{"key": "value"}])), indent=2))
