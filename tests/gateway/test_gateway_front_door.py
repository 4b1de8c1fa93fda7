"""The front door under operators' and hostile clients' eyes: slow clients are dropped, readiness
and liveness, debug routes behind the admin token or off, and the JSON access log."""

from __future__ import annotations

import asyncio
import logging
import time

import aiohttp
import orjson
import pytest

from kvgate.config.settings import DebugRoutes
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import assert_nothing_in_flight, gateway_settings, tokenizer, wait_until
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

TOKEN = "s3cret-admin-token"
# Trickling clients send one byte per step for at most this long: far beyond the 1 s timeout
# used here, so a gateway without the timeout lets the whole trickle through.
_TRICKLE_STEP_S = 0.1
_TRICKLE_BYTES = 80


@pytest.fixture
async def upstream():
    started = await ScriptedUpstream("a", Script()).start()
    yield started
    await started.close()


async def _get(url: str, path: str, headers: dict | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.get(url + path, headers=headers) as response:
        return response.status, await response.read()


async def _trickle(writer: asyncio.StreamWriter, reader: asyncio.StreamReader) -> bytes | None:
    """Send one byte per step; what the server answered once it closed the connection, or None if
    it never did while we trickled."""
    for _ in range(_TRICKLE_BYTES):
        try:
            writer.write(b"a")
            await writer.drain()
        except ConnectionError:
            return b""
        try:
            answer = await asyncio.wait_for(reader.read(), _TRICKLE_STEP_S)
        except TimeoutError:
            continue
        except ConnectionError:
            return b""
        return answer  # read() returns only at EOF
    return None


@pytest.mark.parametrize("sent", ["nothing", "part of the headers"])
async def test_a_client_slow_with_its_headers_is_dropped(upstream, sent):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, client_request_timeout_s=1),
                                 tokenizer=tokenizer())
    try:
        host, port = handle.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        if sent == "nothing":
            closed = await asyncio.wait_for(reader.read(), _TRICKLE_STEP_S * _TRICKLE_BYTES)
            assert closed == b""
        else:
            writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nX-Slow: ")
            assert await _trickle(writer, reader) is not None, "the connection stayed open"
        writer.close()
        # The gateway still serves everyone else.
        assert (await _get(handle.url, "/livez"))[0] == 200
    finally:
        await handle.close()


async def test_a_client_slow_with_its_body_gets_408_and_is_dropped(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, client_request_timeout_s=1),
                                 tokenizer=tokenizer())
    try:
        host, port = handle.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port))
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        answer = await _trickle(writer, reader)
        writer.close()
        assert answer is not None, "the connection stayed open"
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert orjson.loads(body)["error"]["code"] == "request_timeout"
        assert upstream.seen == []
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_readiness_follows_routable_instances_and_liveness_stays_up(upstream):
    handle = await start_gateway(
        gateway_settings({"a": upstream.url}, MODEL, health_check_interval_s=0.1, health_check_failures_to_eject=1),
        tokenizer=tokenizer())
    try:
        status, body = await _get(handle.url, "/health")
        assert status == 200 and orjson.loads(body)["routable_instances"] == 1

        upstream.script.health_status = 503  # the only instance is ejected: still tried (panic routing)
        registry = handle.app[GATEWAY].registry
        await wait_until(lambda: registry.panicking(MODEL))
        status, body = await _get(handle.url, "/health")
        assert status == 200 and orjson.loads(body)["panic_instances"] == 1
        registry.drain("a")  # nothing left to try
        await wait_until_status(handle.url, "/health", 503)
        status, body = await _get(handle.url, "/health")
        payload = orjson.loads(body)
        assert payload["status"] == "unavailable" and payload["routable_instances"] == 0
        assert "routable" in payload["reason"]
        assert (await _get(handle.url, "/livez"))[0] == 200
    finally:
        await handle.close()


async def test_a_gateway_without_instances_is_alive_but_not_ready():
    handle = await start_gateway(gateway_settings({}, MODEL), tokenizer=tokenizer())
    try:
        status, body = await _get(handle.url, "/health")
        assert status == 503 and orjson.loads(body)["reason"] == "no instance configured"
        assert await _get(handle.url, "/livez") == (200, b'{"status":"alive"}')
    finally:
        await handle.close()


async def wait_until_status(url: str, path: str, expected: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while (await _get(url, path))[0] != expected:
        assert time.monotonic() < deadline, f"{path} never answered {expected}"
        await asyncio.sleep(0.05)


@pytest.mark.parametrize("mode,anonymous,with_token", [
    (DebugRoutes.PUBLIC, 200, 200),
    (DebugRoutes.ADMIN, 401, 200),
    (DebugRoutes.OFF, 404, 404),
])
async def test_debug_routes_public_admin_or_off(upstream, mode, anonymous, with_token):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, admin_token=TOKEN, debug_routes=mode),
                                 tokenizer=tokenizer())
    body = {"model": MODEL, "prompt": "hello"}
    admin = {"Authorization": f"Bearer {TOKEN}"}
    try:
        async with aiohttp.ClientSession() as session:
            for headers, expected in ((None, anonymous), (admin, with_token)):
                async with session.get(handle.url + "/metrics", headers=headers) as response:
                    assert response.status == expected
                async with session.post(handle.url + "/debug/schedule", json=body, headers=headers) as response:
                    assert response.status == expected
                    if expected != 200:
                        assert "error" in await response.json()
        assert (await _get(handle.url, "/health"))[0] == 200  # never behind the token
    finally:
        await handle.close()


async def test_access_log_has_one_json_line_per_request(upstream, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, access_log=True), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            async with aiohttp.ClientSession() as session:
                whole = {"model": MODEL, "prompt": "hello there"}
                async with session.post(handle.url + "/v1/completions", json=whole,
                                        headers={"X-Request-Id": "rid-whole"}) as response:
                    assert response.status == 200
                async with session.post(handle.url + "/v1/completions", json={**whole, "stream": True},
                                        headers={"X-Request-Id": "rid-stream"}) as response:
                    assert b"[DONE]" in await response.read()
                async with session.post(handle.url + "/v1/completions", json={**whole, "model": "nope"},
                                        headers={"X-Request-Id": "rid-404"}) as response:
                    assert response.status == 404
            await wait_until(lambda: len([r for r in caplog.records if r.name == "kvgate.access"]) >= 3)
        lines = {entry["request_id"]: entry
                 for entry in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access")}
        assert set(lines) == {"rid-whole", "rid-stream", "rid-404"}
        ok = lines["rid-whole"]
        assert (ok["status"], ok["outcome"], ok["model"], ok["instance"]) == (200, "ok", MODEL, "a")
        assert ok["prompt_tokens"] > 0 and ok["prefix_hit_tokens"] == 0
        assert ok["completion_tokens"] == upstream.script.chunks  # from the engine's usage
        assert 0 < ok["ttft_s"] <= ok["duration_s"]
        streamed = lines["rid-stream"]
        assert streamed["outcome"] == "ok" and streamed["instance"] == "a" and streamed["ttft_s"] > 0
        refused = lines["rid-404"]
        assert (refused["status"], refused["outcome"], refused["instance"]) == (404, "client_error", None)
    finally:
        await handle.close()


async def test_access_log_is_off_by_default(upstream, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            assert (await _get(handle.url, "/v1/models"))[0] == 200
        assert not [r for r in caplog.records if r.name == "kvgate.access"]
    finally:
        await handle.close()


async def test_access_log_names_broken_streams_and_hang_ups(caplog):
    broken = await ScriptedUpstream("broken", Script(chunks=3, die_after_chunks=1)).start()
    slow = await ScriptedUpstream("slow", Script(chunks=50, delay_s=0.05)).start()
    settings = gateway_settings({"broken": broken.url, "slow": slow.url}, MODEL, access_log=True,
                                dispatch_policy="round_robin", forward_retries=0)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    body = {"model": MODEL, "prompt": "hello", "stream": True}
    try:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            async with aiohttp.ClientSession() as session:
                for request_id in ("rid-1", "rid-2"):  # round robin: one to each instance
                    response = await session.post(handle.url + "/v1/completions", json=body,
                                                  headers={"X-Request-Id": request_id})
                    first_event = await response.content.readuntil(b"\n\n")
                    if b"slow-0" in first_event:
                        response.close()  # hang up on the slow one
                    else:
                        await response.read()
            # Only the access log's lines: other loggers may report, e.g. a client a test left open.
            await wait_until(lambda: len([r for r in caplog.records if r.name == "kvgate.access"]) >= 2)
        outcomes = {entry["instance"]: (entry["status"], entry["outcome"])
                    for entry in (orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access")}
        assert outcomes == {"broken": (200, "stream_error"), "slow": (499, "client_closed")}
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await broken.close()
        await slow.close()
