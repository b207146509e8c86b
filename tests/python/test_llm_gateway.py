"""examples/llm_gateway end to end: ratekeeper on the example's limits file
with small numbers, the fake model, and the gateway in front of it, driven
over HTTP as an OpenAI client would; with the in-memory store and with a
redis-server of its own.

Per user, PER_MINUTE tokens a minute and PER_DAY a day (the example's two
limits, scaled down). Each test uses users of its own and starts in a
fresh minute; the per-day test (in-memory store only: it waits for the next
minute) crosses into the next one.
"""
from __future__ import annotations

import contextlib
import functools
import http.client
import importlib.util
import json
import re
import sys
import time
import urllib.error
import urllib.request
import uuid

import pytest
import yaml

from conftest import REPO, run_announcing, run_redis, run_server
from rls_client import wait_for_fresh_window

EXAMPLE = REPO / "examples" / "llm_gateway"
LIMITS_FILE = EXAMPLE / "limits" / "llm-gateway.yaml"
LISTENING = re.compile(r"^listening http=(\S+)$")
PER_MINUTE, PER_DAY = 1000, 1500
MAX_TOKENS = 200


@functools.lru_cache(maxsize=None)
def load_gateway_module():
    """The gateway's own module, for its prompt estimate."""
    spec = importlib.util.spec_from_file_location("llm_gateway_example", EXAMPLE / "gateway.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def limits(tmp_path_factory):
    """The example's limits file with its two numbers made small."""
    doc = yaml.safe_load(LIMITS_FILE.read_text())
    rule = doc["descriptors"][0]
    assert rule["key"] == "user_id"
    by_name = {limit["name"]: limit for limit in rule["rate_limits"]}
    assert set(by_name) == {"tokens_per_minute", "tokens_per_day"}
    assert (by_name["tokens_per_minute"]["unit"], by_name["tokens_per_day"]["unit"]) == ("minute", "day")
    by_name["tokens_per_minute"]["requests_per_unit"] = PER_MINUTE
    by_name["tokens_per_day"]["requests_per_unit"] = PER_DAY
    path = tmp_path_factory.mktemp("llm-limits")
    (path / "llm-gateway.yaml").write_text(yaml.safe_dump(doc))
    return doc["domain"], path


@contextlib.contextmanager
def run_python(script, log_path, *args):
    with run_announcing([sys.executable, str(EXAMPLE / script), "--listen", "127.0.0.1:0", *args],
                        log_path, LISTENING, script) as (match, _):
        yield match[1]


@contextlib.contextmanager
def run_stack(limits, logs, *server_args, gateway_args=()):
    """ratekeeper, the fake model and the gateway; yields the gateway's base URL."""
    domain, limits_dir = limits
    with run_server(limits_dir, logs / "ratekeeper.log", *server_args) as server, \
            run_python("fake_model.py", logs / "fake_model.log") as model, \
            run_python("gateway.py", logs / "gateway.log", "--upstream", f"http://{model}",
                       "--ratekeeper", server.grpc_addr, "--domain", domain,
                       "--api-keys", str(EXAMPLE / "keys.txt"), "--trust-x-user-id", *gateway_args) as gw:
        yield f"http://{gw}"


@pytest.fixture(scope="module", params=["memory", "redis"])
def gateway(request, limits, tmp_path_factory):
    """The three pieces, ratekeeper on the in-memory store or on Redis."""
    logs = tmp_path_factory.mktemp(f"llm-gateway-{request.param}")
    with contextlib.ExitStack() as stack:
        server_args = []
        if request.param == "redis":
            server_args = ["--redis-url", stack.enter_context(run_redis(logs / "redis.log"))]
        yield stack.enter_context(run_stack(limits, logs, *server_args))


@pytest.fixture(scope="module")
def memory_gateway(limits, tmp_path_factory):
    with run_stack(limits, tmp_path_factory.mktemp("llm-gateway-daily")) as url:
        yield url


def chat(url, content, user=None, max_tokens=MAX_TOKENS, model="fake-1", headers=None, body=None):
    """POSTs a chat completion; returns (status, headers, JSON body)."""
    data = body if body is not None else json.dumps(
        {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}).encode()
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=data, method="POST",
                                     headers={"content-type": "application/json", **(headers or {})})
    if user:
        request.add_header("x-user-id", user)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.headers, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, e.headers, json.loads(e.read())


def estimate(content, max_tokens=MAX_TOKENS):
    return load_gateway_module().estimate_prompt_tokens([{"role": "user", "content": content}]) + max_tokens


def new_user():
    return f"u-{uuid.uuid4().hex[:10]}"


LONG = "Tell me a long story"  # no length asked: the model writes max_tokens


def spend_until_refused(url, user, content=LONG, limit=20):
    """Sends requests until one is refused; returns (tokens used by the
    answered ones, their count, the refusal (status, headers, body))."""
    used = 0
    for n in range(limit):
        status, headers, body = chat(url, content, user)
        if status != 200:
            return used, n, (status, headers, body)
        used += body["usage"]["total_tokens"]
    pytest.fail(f"no refusal in {limit} requests")


def test_requests_pass_until_max_tokens_would_exceed_the_minute(gateway):
    wait_for_fresh_window(60, margin_s=15)
    user, need = new_user(), estimate(LONG)
    used, answered, (status, headers, body) = spend_until_refused(gateway, user)
    # Each answer used its whole max_tokens; the next reservation of
    # prompt + max_tokens would not have fit.
    assert answered == PER_MINUTE // need > 0
    assert PER_MINUTE - used < need
    assert status == 429
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "tokens"
    assert 1 <= int(headers["retry-after"]) <= 60
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - used

    # Another user has a budget of their own.
    status, headers, body = chat(gateway, LONG, new_user())
    assert status == 200
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - body["usage"]["total_tokens"]


def test_settling_at_actual_usage_frees_the_unused_estimate(gateway):
    """Short answers: each reserves about max_tokens but uses a few, so many
    more than PER_MINUTE / max_tokens requests pass."""
    wait_for_fresh_window(60, margin_s=15)
    user, used = new_user(), 0
    count = 2 * PER_MINUTE // MAX_TOKENS
    for _ in range(count):
        status, headers, body = chat(gateway, "Say hello in 3 words", user)
        assert status == 200, body
        assert body["usage"]["completion_tokens"] == 3
        used += body["usage"]["total_tokens"]
        assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - used
    assert count > PER_MINUTE // estimate("Say hello in 3 words")


def test_many_callers_at_once_are_all_answered_within_the_budget(gateway):
    """64 callers of one user at once: every one answered (the gateway's
    listen backlog was socketserver's 5, and some were reset), and what the
    200s used fits the minute. A 503 is an answer too: under load a
    Reserve can miss Redis's 20 ms deadline, and the gateway says so."""
    from concurrent.futures import ThreadPoolExecutor

    wait_for_fresh_window(60, margin_s=15)
    user = new_user()
    with ThreadPoolExecutor(max_workers=64) as pool:
        answers = list(pool.map(lambda _: chat(gateway, LONG, user), range(64)))
    statuses = [status for status, _, _ in answers]
    assert 200 in statuses and set(statuses) <= {200, 429, 503}, statuses
    used = sum(body["usage"]["total_tokens"] for status, _, body in answers if status == 200)
    assert 0 < used <= PER_MINUTE


def test_a_failed_upstream_is_settled_at_zero(gateway):
    wait_for_fresh_window(60, margin_s=15)
    user = new_user()
    status, headers, body = chat(gateway, LONG, user, model="fake-down")
    assert status == 503 and body["error"]["type"] == "server_error"
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE
    status, headers, body = chat(gateway, LONG, user)
    assert status == 200
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - body["usage"]["total_tokens"]


def test_an_unreachable_upstream_is_settled_at_zero(limits, tmp_path):
    domain, limits_dir = limits
    with run_server(limits_dir, tmp_path / "ratekeeper.log") as server, \
            run_python("gateway.py", tmp_path / "gateway.log", "--upstream", "http://127.0.0.1:1",
                       "--ratekeeper", server.grpc_addr, "--domain", domain, "--trust-x-user-id") as gw:
        wait_for_fresh_window(60, margin_s=10)
        user = new_user()
        for _ in range(2 * PER_MINUTE // MAX_TOKENS):
            status, headers, body = chat(f"http://{gw}", LONG, user)
            assert status == 502 and body["error"]["type"] == "server_error"
            assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE


def test_an_answer_lost_after_sending_stays_charged_at_the_estimate(limits, tmp_path):
    """The model got the request but no answer came back in time: it may
    have generated, and billed, every token; the budget keeps the estimate."""
    with run_stack(limits, tmp_path, gateway_args=("--upstream-timeout", "0.5")) as gw:
        wait_for_fresh_window(60, margin_s=10)
        user = new_user()
        status, headers, body = chat(gw, LONG, user, model="fake-slow")
        assert status == 502 and body["error"]["type"] == "server_error"
        assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - estimate(LONG)


def test_an_estimate_over_the_limit_is_a_400_not_a_429(gateway):
    """No wait would make it fit: a 429 with Retry-After would have the
    client retry forever. The budget is untouched."""
    wait_for_fresh_window(60, margin_s=15)
    user = new_user()
    status, headers, body = chat(gateway, "hi", user, max_tokens=PER_MINUTE + 1)
    assert status == 400 and body["error"]["code"] == "tokens_exceed_limit"
    assert "retry-after" not in headers
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE
    status, headers, body = chat(gateway, "Say hi in 2 words", user)
    assert status == 200
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - body["usage"]["total_tokens"]


def test_max_completion_tokens_is_read_like_max_tokens(gateway):
    """OpenAI's newer name: what is reserved, what the model is held to."""
    wait_for_fresh_window(60, margin_s=15)
    user = new_user()
    request = {"model": "fake-1", "messages": [{"role": "user", "content": LONG}], "max_completion_tokens": 7}
    status, headers, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 200 and body["usage"]["completion_tokens"] == 7
    request["max_completion_tokens"] = PER_MINUTE + 1
    status, _, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 400 and body["error"]["code"] == "tokens_exceed_limit"
    request["max_completion_tokens"] = 0
    status, _, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 400 and "max_completion_tokens" in body["error"]["message"]


def test_without_ratekeeper_nothing_is_forwarded(limits, tmp_path):
    """Fail closed: no reservation, no model call (a forwarded request would
    have met the unreachable upstream: 502)."""
    with run_python("gateway.py", tmp_path / "gateway.log", "--upstream", "http://127.0.0.1:1",
                    "--ratekeeper", "127.0.0.1:1", "--ratekeeper-timeout", "0.5", "--trust-x-user-id") as gw:
        status, _, body = chat(f"http://{gw}", LONG, new_user())
    assert status == 503 and body["error"]["message"].startswith("Rate limiter failed (UNAVAILABLE")


def test_x_user_id_names_the_user_only_when_trusted(tmp_path):
    """Without --trust-x-user-id a client cannot name a user (and so dodge
    its budget) with a header: only an API key identifies it."""
    with run_python("gateway.py", tmp_path / "gateway.log", "--upstream", "http://127.0.0.1:1",
                    "--ratekeeper", "127.0.0.1:1", "--api-keys", str(EXAMPLE / "keys.txt")) as gw:
        status, _, body = chat(f"http://{gw}", LONG, new_user())
    assert status == 401 and "x-user-id" not in body["error"]["message"], body


def test_the_daily_limit_refuses_across_minutes(memory_gateway):
    gateway = memory_gateway
    wait_for_fresh_window(60, margin_s=15)
    user, need = new_user(), estimate(LONG)
    first_minute, _, (status, headers, _) = spend_until_refused(gateway, user)
    assert status == 429 and int(headers["retry-after"]) <= 60  # the minute's limit

    time.sleep(60 - time.time() % 60 + 0.1)  # into the next minute
    second_minute, answered, (status, headers, body) = spend_until_refused(gateway, user)
    # The day has PER_DAY - first_minute left, less than this minute's budget.
    assert PER_DAY - first_minute < PER_MINUTE
    assert answered == (PER_DAY - first_minute) // need
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
    assert int(headers["retry-after"]) > 60, "refused by the day's limit, not the minute's"
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_DAY - first_minute - second_minute


def test_the_request_is_held_to_what_was_reserved(gateway):
    """No max_tokens (or null): the gateway reserves its default and writes
    it into the request, so the model (whose own limit is 4,096) stops
    there; n choices reserve, and are billed, n times."""
    wait_for_fresh_window(60, margin_s=15)
    module, user = load_gateway_module(), new_user()
    for cap in ({}, {"max_tokens": None}):
        request = {"model": "fake-1", "messages": [{"role": "user", "content": LONG}], **cap}
        status, headers, body = chat(gateway, None, user, body=json.dumps(request).encode())
        assert status == 200 and body["usage"]["completion_tokens"] == module.DEFAULT_MAX_TOKENS, body
    user = new_user()
    request = {"model": "fake-1", "messages": [{"role": "user", "content": LONG}], "max_tokens": 100, "n": 3}
    status, headers, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 200 and len(body["choices"]) == 3 and body["usage"]["completion_tokens"] == 300
    assert int(headers["x-ratelimit-remaining-tokens"]) == PER_MINUTE - body["usage"]["total_tokens"]
    request["n"] = PER_MINUTE // 100  # 10 x 100 and the prompt: more than the minute admits
    status, _, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 400 and body["error"]["code"] == "tokens_exceed_limit", body
    request["n"] = 0
    status, _, body = chat(gateway, None, user, body=json.dumps(request).encode())
    assert status == 400 and "'n'" in body["error"]["message"]


def test_usage_without_total_tokens_is_its_prompt_and_completion_tokens():
    total_tokens = load_gateway_module().total_tokens
    assert total_tokens(b'{"usage": {"total_tokens": 7, "prompt_tokens": 1}}') == 7
    assert total_tokens(b'{"usage": {"prompt_tokens": 3, "completion_tokens": 4}}') == 7
    for body in (b'{"usage": {"prompt_tokens": 3}}', b'{"usage": {"total_tokens": -1}}', b'{}', b'not json'):
        assert total_tokens(body) is None, body


def test_users_are_identified_by_api_key_or_header(gateway):
    wait_for_fresh_window(60, margin_s=15)
    status, headers, body = chat(gateway, "Say hi in 1 word", headers={"authorization": "Bearer sk-demo-alice"})
    assert status == 200
    status, _, body = chat(gateway, "hi", headers={"authorization": "Bearer sk-wrong"})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    status, _, body = chat(gateway, "hi")
    assert status == 401 and "x-user-id" in body["error"]["message"]


def test_bad_requests_are_refused_before_reserving(gateway):
    user = new_user()
    status, _, body = chat(gateway, None, user, body=b"{not json")
    assert status == 400 and body["error"]["type"] == "invalid_request_error"
    for max_tokens in (0, 10**6, "many"):
        status, _, body = chat(gateway, "hi", user, max_tokens=max_tokens)
        assert status == 400 and "max_tokens" in body["error"]["message"]
    for length in ("-1", str(2 << 20), "many"):  # not read: no hang, no huge read
        connection = http.client.HTTPConnection(gateway.removeprefix("http://"), timeout=5)
        connection.putrequest("POST", "/v1/chat/completions")
        connection.putheader("x-user-id", user)
        connection.putheader("content-length", length)
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 400 and b"Content-Length" in response.read()
        connection.close()
    status, _, body = chat(gateway, None, user, body=json.dumps({"messages": []}).encode())
    assert status == 400 and "messages" in body["error"]["message"]
    status, _, body = chat(gateway, None, user, body=json.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True}).encode())
    assert status == 400 and "Streaming" in body["error"]["message"]
