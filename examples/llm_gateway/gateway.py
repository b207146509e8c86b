"""An LLM gateway: an HTTP proxy in front of an OpenAI-style model endpoint
that holds every user to a token budget per minute and per day, kept by
ratekeeper with reserve-then-settle (ratekeeper.v1.BudgetService).

A call's tokens are known only when the model has answered, but bounded
before it starts: the prompt (estimated here) plus `max_tokens`. So, per
`POST /v1/chat/completions`:

1. the user is identified: `Authorization: Bearer <API key>` looked up in
   the --api-keys file, or, only with --trust-x-user-id (an auth proxy in
   front sets it, and strips a client's own), the `x-user-id` header.
   Neither: 401.
2. the gateway reserves the most the call can cost on the descriptor
   [user_id=<user>] of --domain, whose rule holds two limits (tokens per
   minute and per day: limits/llm-gateway.yaml): the prompt's estimate plus
   `max_completion_tokens` (or the older `max_tokens`; DEFAULT_MAX_TOKENS
   when the request sets neither) for each of its `n` choices. Refused: 429
   with Retry-After and an OpenAI-style error body; the model is not
   called. An estimate more than a limit admits at once can never be
   granted: 400.
3. it forwards the request, with `max_completion_tokens` written in when
   the client set no cap (so the model is held to what was reserved), and settles the
   reservation at the answer's `usage.total_tokens` (or its prompt plus
   completion tokens), which gives the unused part of the estimate back. A
   prompt that cost more than its estimate is charged the excess.
   The model refused or failed the request (a 4xx or 5xx), or was never
   reached (nothing listening, no such host): it is settled at 0. The
   request was sent but no whole answer came back (a timeout, a reset
   connection): the model may have generated, and billed, every token, so
   it stays charged at the estimate, as does an answer without usage (the
   client's budget() does that when nothing was spent).

Answers carry `x-ratelimit-limit-tokens` and `x-ratelimit-remaining-tokens`
(the tightest of the two limits, after the settlement), as OpenAI's do.
Streaming (`"stream": true`) is not handled by this example.

    python gateway.py --listen 127.0.0.1:8000 --upstream http://127.0.0.1:8001 \\
        --ratekeeper 127.0.0.1:8081 --api-keys keys.txt

Started on port 0 it prints `listening http=HOST:PORT` once it listens.
Needs grpcio and grpcio-tools (the ratekeeper client, ../clients/python,
generates its stubs from the repository's proto/ at start).
"""
from __future__ import annotations

import argparse
import http.client
import json
import math
import socket
import sys
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "clients" / "python"))
import grpc  # noqa: E402
import ratekeeper_client as rk  # noqa: E402

DEFAULT_MAX_TOKENS = 256
# The most choices (`n`) a request may ask for, as OpenAI's API allows.
MAX_CHOICES = 128
# The largest request body read.
MAX_BODY_BYTES = 1 << 20
# The most a request may ask for: a cap on one reservation.
MAX_TOKENS_CAP = 32_768
# The longest TTL ratekeeper gives a reservation (1 h).
MAX_RESERVATION_TTL = 3600
# A token per 3 bytes of UTF-8: generous for English (about 4 characters a
# token), about right for CJK text (3 bytes a character, about a token
# each) and code; each message costs a few more for its role and framing.
# An estimate: the settle charges what the model reports.
BYTES_PER_TOKEN = 3
TOKENS_PER_MESSAGE = 4


def estimate_prompt_tokens(messages: list) -> int:
    return sum(math.ceil(len(str(m.get("content", "")).encode()) / BYTES_PER_TOKEN) + TOKENS_PER_MESSAGE
               for m in messages)


def read_api_keys(path: Optional[str]) -> dict:
    """`<key> <user id>` per line; blank lines and `#` comments skipped."""
    keys = {}
    if path is None:
        return keys
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise SystemExit(f"{path}:{number}: expected `<API key> <user id>`")
        keys[parts[0]] = parts[1]
    return keys


def openai_error(message: str, kind: str, code: Optional[str] = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


class BadRequest(Exception):
    """A request the gateway refuses before reserving: (status, body)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", code=None):
        super().__init__(message)
        self.status = status
        self.body = openai_error(message, kind, code)


class Unreached(OSError):
    """The upstream never got the request: nothing listening, no such host."""


class Gateway:
    """What the handler threads share: the ratekeeper client (one gRPC
    channel), the upstream, the API keys."""

    def __init__(self, args):
        self.upstream = args.upstream.rstrip("/")
        self.upstream_timeout = args.upstream_timeout
        self.domain = args.domain
        self.api_keys = read_api_keys(args.api_keys)
        self.trust_x_user_id = args.trust_x_user_id
        # Settle within the reservation's TTL: the longest an upstream call
        # may take, and a margin, within what ratekeeper gives (a call that
        # outlives it stays charged at its estimate).
        self.reservation_ttl = min(args.upstream_timeout + 30, MAX_RESERVATION_TTL)
        self.limiter = rk.RateLimitClient(args.ratekeeper, timeout=args.ratekeeper_timeout)

    def user(self, headers) -> str:
        auth = headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            user = self.api_keys.get(auth[7:].strip())
            if user is None:
                raise BadRequest(401, "Incorrect API key provided.", code="invalid_api_key")
            return user
        user = headers.get("x-user-id", "").strip() if self.trust_x_user_id else ""
        if not user:
            also = " and no x-user-id" if self.trust_x_user_id else ""
            raise BadRequest(401, f"No API key provided (Authorization: Bearer <key>){also}.")
        return user

    def forward(self, body: bytes) -> tuple[int, bytes]:
        """The upstream's status and body; raises Unreached when the request
        never got to it, OSError or HTTPException when no whole answer came
        back."""
        request = urllib.request.Request(
            f"{self.upstream}/v1/chat/completions", data=body,
            headers={"content-type": "application/json"}, method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.upstream_timeout) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as e:  # answered, with an error status
            return e.code, e.read()
        except urllib.error.URLError as e:
            if isinstance(e.reason, (ConnectionRefusedError, socket.gaierror)):
                raise Unreached(e.reason) from e
            raise


def parse_chat_request(raw: bytes) -> tuple[int, bytes]:
    """The most a chat completion request can cost (its estimate), and the
    body to forward: the request, holding the model to that estimate."""
    try:
        request = json.loads(raw)
    except ValueError as e:
        raise BadRequest(400, f"The body is not valid JSON: {e}") from None
    if not isinstance(request, dict) or not isinstance(request.get("messages"), list) or not request["messages"]:
        raise BadRequest(400, "'messages' must be a non-empty list.")
    if not all(isinstance(m, dict) for m in request["messages"]):
        raise BadRequest(400, "Each message must be an object.")
    if request.get("stream"):
        raise BadRequest(400, "Streaming is not supported by this gateway.")
    # max_completion_tokens is what OpenAI's API names it now; max_tokens
    # the older name, still sent by many clients. null is unset, as there.
    caps = {name: request[name] for name in ("max_completion_tokens", "max_tokens")
            if request.get(name) is not None}
    for name, value in caps.items():
        if type(value) is not int or not 1 <= value <= MAX_TOKENS_CAP:
            raise BadRequest(400, f"'{name}' must be an integer from 1 to {MAX_TOKENS_CAP}.")
    if not caps:
        # Without a cap the model would write up to its own limit, past
        # what is reserved: send it the one reserved for, by the name every
        # current model takes (some refuse the older max_tokens).
        request["max_completion_tokens"] = caps["max_completion_tokens"] = DEFAULT_MAX_TOKENS
    choices = request.get("n")
    if choices is None:
        choices = 1
    if type(choices) is not int or not 1 <= choices <= MAX_CHOICES:
        raise BadRequest(400, f"'n' must be an integer from 1 to {MAX_CHOICES}.")
    # Each choice is written, and billed, up to the cap.
    completion = max(caps.values()) * choices
    return estimate_prompt_tokens(request["messages"]) + completion, json.dumps(request).encode()


def total_tokens(body: bytes) -> Optional[int]:
    """usage.total_tokens of a model's answer, else its prompt_tokens plus
    completion_tokens, if it has them."""
    try:
        usage = json.loads(body)["usage"]
        parts = [usage["total_tokens"]] if "total_tokens" in usage else \
            [usage["prompt_tokens"], usage["completion_tokens"]]
    except (ValueError, KeyError, TypeError):
        return None
    if not all(type(n) is int and n >= 0 for n in parts):
        return None
    return sum(parts)


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    gateway: Gateway  # set on the class by main()

    def do_POST(self):
        try:
            length = int(self.headers.get("content-length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True  # the body, if any, is not read
            return self.answer(400, openai_error(
                f"Content-Length must be a number of bytes up to {MAX_BODY_BYTES}.", "invalid_request_error"))
        raw = self.rfile.read(length)
        if self.path != "/v1/chat/completions":
            return self.answer(404, openai_error(f"Unknown route {self.path}.", "invalid_request_error"))
        try:
            user = self.gateway.user(self.headers)
            estimate, body = parse_chat_request(raw)
            self.complete(user, body, estimate)
        except BadRequest as e:
            self.answer(e.status, e.body)
        except rk.BudgetExceeded as e:
            self.refuse(e)
        except grpc.RpcError as e:
            # No reservation (ratekeeper unreachable, its store down, or a
            # domain it does not know): fail closed, nothing was forwarded.
            self.answer(503, openai_error(f"Rate limiter failed ({e.code().name}: {e.details()}).", "server_error"))

    def complete(self, user: str, request: bytes, estimate: int) -> None:
        gw = self.gateway
        status, body = 502, b""
        # A failed reserve raises (do_POST answers 503); a failed settle
        # does not: the reservation stays charged at its estimate until its
        # TTL, the client logs it, and the answer is sent all the same.
        with gw.limiter.budget(gw.domain, [{"user_id": user}], estimate, ttl=gw.reservation_ttl) as budget:
            try:
                status, body = gw.forward(request)
            except Unreached as e:
                budget.spend(0)  # never reached the model: nothing to pay for
                body = json.dumps(openai_error(f"Upstream failed: {e}", "server_error")).encode()
            except (OSError, http.client.HTTPException) as e:
                # Sent, but no whole answer: it may have cost up to the
                # estimate, which is what an unreported budget settles at.
                body = json.dumps(openai_error(f"Upstream failed: {e}", "server_error")).encode()
            else:
                used = total_tokens(body) if status == 200 else 0
                if used is not None:  # none in a 200: settled at the estimate
                    budget.spend(min(used, rk.MAX_HITS))  # more is no usage a settle takes
        self.answer(status, body, self.budget_headers(budget.settlement))

    def refuse(self, e: rk.BudgetExceeded) -> None:
        status = e.statuses[0] if e.statuses else None
        limit = f"Limit {status.limit}, remaining {status.remaining}. " if status else ""
        if e.retry_after is None:
            # More than the limit admits at once: waiting cannot help.
            return self.answer(400, openai_error(
                f"This request may use more tokens than your limit allows at once. {limit}"
                "Lower max_completion_tokens (or max_tokens) or shorten the prompt.",
                "invalid_request_error", "tokens_exceed_limit"), self.budget_headers(e.reservation))
        wait = max(1, math.ceil(e.retry_after.total_seconds()))
        body = openai_error(f"Rate limit reached for tokens. {limit}Please try again in {wait}s.",
                            "tokens", "rate_limit_exceeded")
        self.answer(429, body, {"retry-after": str(wait), **self.budget_headers(e.reservation)})

    @staticmethod
    def budget_headers(answer) -> dict:
        if answer is None or not answer.statuses or not answer.statuses[0].limit:
            return {}
        status = answer.statuses[0]
        return {"x-ratelimit-limit-tokens": str(status.limit), "x-ratelimit-remaining-tokens": str(status.remaining)}

    def answer(self, status: int, body, headers: Optional[dict] = None) -> None:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002 (the base class' name)
        sys.stderr.write("gateway: " + format % args + "\n")


class Server(ThreadingHTTPServer):
    # The listen backlog; socketserver's default, 5, reset the connections
    # of clients past a few arriving at once.
    request_queue_size = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:8000", help="HOST:PORT (port 0: any free port)")
    parser.add_argument("--upstream", default="http://127.0.0.1:8001", help="the model endpoint's base URL")
    parser.add_argument("--upstream-timeout", type=float, default=120.0, help="seconds")
    parser.add_argument("--ratekeeper", default="127.0.0.1:8081", help="ratekeeper's gRPC HOST:PORT")
    parser.add_argument("--ratekeeper-timeout", type=float, default=1.0, help="seconds per call")
    parser.add_argument("--domain", default="llm-gateway", help="the limits file's domain")
    parser.add_argument("--api-keys", help="file of `<API key> <user id>` lines")
    parser.add_argument("--trust-x-user-id", action="store_true",
                        help="take the x-user-id header as the user when no API key is sent "
                             "(only behind an auth proxy that sets it)")
    args = parser.parse_args()

    rk.load_stubs()
    Handler.gateway = Gateway(args)
    host, _, port = args.listen.rpartition(":")
    server = Server((host, int(port)), Handler)
    print(f"listening http={server.server_address[0]}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
