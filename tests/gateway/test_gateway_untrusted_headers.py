"""Clients' headers are not trusted: bytes that are not UTF-8, oversized or countless headers, long
request ids, guessed keys, open debug routes. Each gets an OpenAI-style answer (never a 500), the
access log keeps its line, and the process log stays bounded."""

from __future__ import annotations

import asyncio
import logging
import random
import re

import aiohttp
import orjson
import pytest

from kvgate.config.loader import load_settings
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    counter_value,
    gateway_records,
    gateway_settings,
    tokenizer,
    wait_until,
)
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

API_KEY = "team-a-key-0123456789abcdef"
ADMIN_TOKEN = "admin-token-0123456789"
BODY = orjson.dumps({"model": MODEL, "prompt": "hi"})
GATEWAY_ID = re.compile(r"[0-9a-f]{32}")


@pytest.fixture
async def upstream():
    started = await ScriptedUpstream("a", Script()).start()
    yield started
    await started.close()


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"team-a:{API_KEY}\n")
    return str(path)


async def raw_request(url: str, head: bytes, body: bytes = b"", source: str = "127.0.0.1") -> tuple[int, dict, bytes]:
    """Send `head` (request line and header lines, without the blank line) and `body` as they are, on
    a connection of their own from `source`; the status, headers and body of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port), local_addr=(source, 0))
    try:
        writer.write(head + b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    header_block, _, payload = answer.partition(b"\r\n\r\n")
    lines = header_block.split(b"\r\n")
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers[name.decode().lower()] = value.strip().decode("latin-1")
    return int(lines[0].split()[1]), headers, payload


def completion_head(*extra: bytes) -> bytes:
    return b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n" + b"".join(extra)


def sent_request_id(upstream: ScriptedUpstream) -> str:
    """The X-Request-Id the engine received (aiohttp spells known header names its own way)."""
    return {name.lower(): value for name, value in upstream.seen[-1].headers.items()}["x-request-id"]


def openai_error(payload: bytes) -> dict:
    error = orjson.loads(payload)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


@pytest.mark.parametrize("request_id", [b"ab\xff\xfe", b"x" * 8000, b"two words", b"tab\there"],
                         ids=["not-utf8", "8000-bytes", "space", "tab"])
async def test_an_unusable_request_id_is_replaced_and_the_request_served(upstream, request_id, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, access_log=True), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            status, headers, payload = await raw_request(
                handle.url, completion_head(b"X-Request-Id: " + request_id + b"\r\n"), BODY)
        assert status == 200 and orjson.loads(payload)["choices"]
        assert GATEWAY_ID.fullmatch(headers["x-request-id"])
        assert sent_request_id(upstream) == headers["x-request-id"]
        lines = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
        assert [(line["request_id"], line["status"]) for line in lines] == [(headers["x-request-id"], 200)]
    finally:
        await handle.close()


async def test_a_usable_request_id_is_kept(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    try:
        status, headers, _ = await raw_request(handle.url, completion_head(b"X-Request-Id: trace-42/abc\r\n"), BODY)
        assert status == 200 and headers["x-request-id"] == "trace-42/abc"
        assert sent_request_id(upstream) == "trace-42/abc"
    finally:
        await handle.close()


async def test_keys_that_are_not_utf8_are_refused_like_any_wrong_key(upstream, keys_file, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  admin_token=ADMIN_TOKEN), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.WARNING):
            status, headers, payload = await raw_request(
                handle.url, completion_head(b"Authorization: Bearer \xff\xfe" + API_KEY.encode() + b"\r\n"), BODY)
            assert status == 401 and openai_error(payload)["code"] == "invalid_api_key"
            assert headers["www-authenticate"] == "Bearer"
            status, _, payload = await raw_request(
                handle.url, b"GET /admin/instances HTTP/1.1\r\nHost: gw\r\nAuthorization: Bearer \xc3\x28\r\n")
            assert status == 403 and openai_error(payload)["type"] == "permission_error"
        assert counter_value(handle, "kvgate_api_key_unauthorized_total") == 1
        assert not [r for r in gateway_records(caplog) if r.exc_info]
        assert upstream.seen == []
    finally:
        await handle.close()


async def test_guessing_keys_spends_the_addresss_failure_budget(upstream, keys_file):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  admin_token=ADMIN_TOKEN, auth_failure_budget=5,
                                                  auth_failure_refill_per_s=0.01), tokenizer=tokenizer())
    try:
        def key(value: str) -> bytes:
            return b"Authorization: Bearer " + value.encode() + b"\r\n"

        statuses = [(await raw_request(handle.url, completion_head(key(f"guess-{n:020d}")), BODY))[0]
                    for n in range(8)]
        assert statuses == [401] * 5 + [429] * 3
        # Once over the budget even the right key waits: the guesser learns nothing meanwhile.
        status, headers, payload = await raw_request(handle.url, completion_head(key(API_KEY)), BODY)
        assert status == 429 and openai_error(payload)["code"] == "auth_failures_throttled"
        assert int(headers["retry-after"]) >= 1
        status, _, _ = await raw_request(handle.url, b"GET /admin/instances HTTP/1.1\r\nHost: gw\r\n"
                                         + key(ADMIN_TOKEN))
        assert status == 429
        # Another address has its own budget.
        status, _, _ = await raw_request(handle.url, completion_head(key(API_KEY)), BODY, source="127.0.0.2")
        assert status == 200
        assert counter_value(handle, "kvgate_auth_failures_throttled_total", scope="api_key") == 4
        assert counter_value(handle, "kvgate_auth_failures_throttled_total", scope="admin") == 1
        assert counter_value(handle, "kvgate_api_key_unauthorized_total") == 5
    finally:
        await handle.close()


@pytest.mark.parametrize(("head", "reason"), [
    (b"GET /livez HTTP/1.1\r\nHost: gw\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)), "too_many_headers"),
    (b"GET /livez HTTP/1.1\r\nHost: gw\r\nX-Big: " + b"a" * 9000 + b"\r\n", "header_too_long"),
    (b"GET /livez HTTP/1.1\r\nHost: gw\r\nX-\x01Bad: v\r\n", "bad_request"),
], ids=["count", "length", "bytes"])
async def test_requests_the_parser_refuses_get_json_and_one_log_line(upstream, head, reason, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.DEBUG):
            for _ in range(20):
                status, headers, payload = await raw_request(handle.url, head)
                assert status == 400 and headers["content-type"].startswith("application/json")
                assert openai_error(payload)["code"] == "malformed_request"
        assert counter_value(handle, "kvgate_malformed_requests_total", reason=reason) == 20
        assert not [r for r in gateway_records(caplog) if r.exc_info]
        assert len([r for r in gateway_records(caplog) if r.levelno >= logging.WARNING]) == 1
        status, _, _ = await raw_request(handle.url, b"GET /livez HTTP/1.1\r\nHost: gw\r\n")
        assert status == 200
    finally:
        await handle.close()


def test_with_api_keys_debug_routes_default_to_the_admin_token(keys_file):
    assert load_settings({}, environ={}).debug_routes == "public"
    assert load_settings({"api_keys_file": keys_file}, environ={}).debug_routes == "admin"
    explicit = load_settings({"api_keys_file": keys_file, "debug_routes": "public"}, environ={})
    assert explicit.debug_routes == "public"


async def test_with_api_keys_metrics_and_debug_need_the_admin_token(upstream, keys_file):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  admin_token=ADMIN_TOKEN), tokenizer=tokenizer())
    try:
        async with aiohttp.ClientSession() as session:
            for method, path in (("GET", "/metrics"), ("POST", "/debug/schedule")):
                async with session.request(method, handle.url + path, data=BODY) as response:
                    assert response.status == 401
                async with session.request(method, handle.url + path, data=BODY,
                                           headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}) as response:
                    assert response.status == 200
    finally:
        await handle.close()


async def test_debug_schedule_plans_a_bounded_number_of_prompts_at_once(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    long_prompt = orjson.dumps({"model": MODEL, "prompt": "word " * 20000})
    try:
        async with aiohttp.ClientSession() as session:
            async def schedule() -> tuple[int, dict]:
                async with session.post(handle.url + "/debug/schedule", data=long_prompt) as response:
                    return response.status, await response.json()

            answers = await asyncio.gather(*(schedule() for _ in range(6)))
        busy = [body for status, body in answers if status == 429]
        assert busy and all(body["error"]["code"] == "debug_busy" for body in busy)
        assert any(status == 200 for status, _ in answers)
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


# --- fuzz: random header bytes, lengths and counts (seeded, bounded) ---

FUZZ_REQUESTS = 160


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        kilobytes = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kilobytes) * 1024


def random_bytes(rng: random.Random, size: int) -> bytes:
    return bytes(rng.getrandbits(8) for _ in range(size))


def fuzzed_headers(rng: random.Random) -> bytes:
    kind = rng.randrange(4)
    if kind == 0:
        return b"X-Request-Id: " + random_bytes(rng, rng.choice((0, 1, 40, 129, 3000, 9000))) + b"\r\n"
    if kind == 1:
        return b"Authorization: Bearer " + random_bytes(rng, rng.randrange(0, 300)) + b"\r\n"
    if kind == 2:
        return b"".join(b"X-F%d: %s\r\n" % (n, random_bytes(rng, rng.randrange(1, 60)))
                        for n in range(rng.randrange(0, 200)))
    return b"X-Long: " + b"v" * rng.choice((10, 8000, 8200, 20000)) + b"\r\n"


async def test_fuzzed_headers_never_get_a_500_nor_flood_the_log(upstream, keys_file, caplog):
    rng = random.Random(20261124)
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  admin_token=ADMIN_TOKEN, access_log=True), tokenizer=tokenizer())
    routes = [completion_head(), b"GET /admin/instances HTTP/1.1\r\nHost: gw\r\n", b"GET /metrics HTTP/1.1\r\nHost: gw\r\n",
              b"GET /livez HTTP/1.1\r\nHost: gw\r\n"]
    rss_before = rss_bytes()
    statuses: dict[int, int] = {}
    try:
        with caplog.at_level(logging.INFO):
            for n in range(FUZZ_REQUESTS):
                route = rng.randrange(len(routes))
                head = routes[route] + fuzzed_headers(rng)
                if rng.random() < 0.5:  # sometimes a valid key beside the noise
                    head += b"Authorization: Bearer " + API_KEY.encode() + b"\r\n"
                source = f"127.0.0.{2 + n % 50}"
                status, headers, payload = await raw_request(handle.url, head, BODY if route == 0 else b"", source)
                statuses[status] = statuses.get(status, 0) + 1
                assert status < 500, (status, payload[:300])
                if status >= 400:
                    assert headers["content-type"].startswith("application/json")
                    openai_error(payload)
                if n % 20 == 0:
                    status, _, _ = await asyncio.wait_for(
                        raw_request(handle.url, b"GET /livez HTTP/1.1\r\nHost: gw\r\n"), 5)
                    assert status == 200
        assert statuses.get(200) and statuses.get(400) and statuses.get(401)  # the fuzz reached each path
        await assert_nothing_in_flight_keyed(handle)
        process_lines = [r for r in gateway_records(caplog) if r.name != "kvgate.access"]
        assert not [r for r in process_lines if r.exc_info]
        assert len(process_lines) <= 5  # throttled: not one line per malformed request
        assert rss_bytes() - rss_before < 100 * 1024 * 1024
    finally:
        await handle.close()


async def assert_nothing_in_flight_keyed(handle) -> None:
    """The account is empty (its gauges are behind the admin token here)."""
    account = handle.app[GATEWAY].account
    await wait_until(lambda: account.total_inflight() == 0)
