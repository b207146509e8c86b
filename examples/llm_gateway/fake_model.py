"""A stand-in for an OpenAI-style model endpoint, so the gateway example runs
without a GPU or an account: `POST /v1/chat/completions` answers a chat
completion with a `usage` object, as the real APIs do.

It "writes" one token per word and bills like a model would:

- prompt_tokens: the words of every message, plus 3 per message (the role
  and the framing a chat template adds);
- completion_tokens: if the last user message asks for a length ("... in 5
  words"), that many, otherwise it rambles on until `max_tokens` cuts it off
  (finish_reason "length"); never more than `max_tokens` (4,096 when the
  request sets none, its own limit, as a real model's); each of `n` choices
  writes and bills as much;
- model `fake-down` always answers 503 (an overloaded upstream), and
  `fake-slow` answers after 3 s (longer than a client's timeout), for
  trying the gateway's failure paths.

    python fake_model.py --listen 127.0.0.1:8001

Started on port 0 it prints `listening http=HOST:PORT` once it listens.
Python standard library only.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

TOKENS_PER_MESSAGE = 3
SLOW_SECONDS = 3
# With no max_tokens it writes up to its own limit, as real models do (the
# gateway must not rely on a small default here).
DEFAULT_MAX_TOKENS = 4096
MAX_BODY_BYTES = 1 << 20
ASKED_LENGTH = re.compile(r"\bin (\d+) words?\b", re.IGNORECASE)


def prompt_tokens(messages: list) -> int:
    return sum(len(str(m.get("content", "")).split()) + TOKENS_PER_MESSAGE for m in messages)


def completion(messages: list, max_tokens: int) -> tuple[str, int, str]:
    """The reply's text, its tokens and its finish_reason."""
    last = next((m for m in reversed(messages) if m.get("role") == "user"), {})
    asked = ASKED_LENGTH.search(str(last.get("content", "")))
    wanted = int(asked.group(1)) if asked else None
    if wanted is not None and wanted <= max_tokens:
        return " ".join(["word"] * wanted), wanted, "stop"
    return " ".join(["word"] * max_tokens), max_tokens, "length"


def error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        if self.path != "/v1/chat/completions":
            self.close_connection = True  # its body is not read
            return self.answer(404, error_body(f"no route {self.path}", "invalid_request_error"))
        try:
            length = int(self.headers.get("content-length") or 0)
            if not 0 <= length <= MAX_BODY_BYTES:
                self.close_connection = True
                raise ValueError(f"Content-Length must be 0 to {MAX_BODY_BYTES}")
            request = json.loads(self.rfile.read(length) or b"{}")
            messages = request["messages"]
            max_tokens = int(request.get("max_completion_tokens") or request.get("max_tokens")
                             or DEFAULT_MAX_TOKENS)
            choices = int(request.get("n") or 1)
            if not isinstance(messages, list) or max_tokens < 1 or choices < 1:
                raise ValueError("messages must be a list, max_tokens and n >= 1")
        except (ValueError, KeyError, TypeError) as e:
            return self.answer(400, error_body(f"bad request: {e}", "invalid_request_error"))
        model = str(request.get("model", "fake-1"))
        if model == "fake-down":
            return self.answer(503, error_body("the model is overloaded", "server_error"))
        if model == "fake-slow":
            time.sleep(SLOW_SECONDS)
        text, tokens, finish = completion(messages, max_tokens)
        prompt = prompt_tokens(messages)
        # Each choice is written, and billed, in full.
        self.answer(200, {
            "id": f"chatcmpl-{uuid.uuid4().hex[:24]}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{
                "index": i,
                "message": {"role": "assistant", "content": text},
                "finish_reason": finish,
            } for i in range(choices)],
            "usage": {"prompt_tokens": prompt, "completion_tokens": tokens * choices,
                      "total_tokens": prompt + tokens * choices},
        })

    def answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format, *args):  # noqa: A002 (the base class' name)
        sys.stderr.write("fake_model: " + format % args + "\n")


class Server(ThreadingHTTPServer):
    # The listen backlog; socketserver's default, 5, reset the connections
    # of clients past a few arriving at once.
    request_queue_size = 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", default="127.0.0.1:8001", help="HOST:PORT (port 0: any free port)")
    args = parser.parse_args()
    host, _, port = args.listen.rpartition(":")
    server = Server((host, int(port)), Handler)
    print(f"listening http={server.server_address[0]}:{server.server_address[1]}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
