"""Forwarding through the gateway: exact relay, retries before the first byte, failures after it,
client hang-ups, request ids. Engines are scripted doubles on loopback (tests/scripted_upstream.py)
where a failure must be injected; the real mock engine elsewhere (test_gateway_end_to_end.py)."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest
from multidict import CIMultiDict

from kvgate.gateway.http.server import start_gateway
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    gateway_settings,
    inflight_gauges,
    tokenizer,
)
from tests.openai_helpers import openai_client
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

pytestmark = pytest.mark.usefixtures("close_openai_clients")


@pytest.fixture
async def fleet():
    """Start scripted upstreams and one gateway in front of them; everything closed afterwards."""
    opened: list = []

    async def make(scripts: dict[str, Script | str], **overrides):
        upstreams, urls = {}, {}
        for name, script in scripts.items():
            if isinstance(script, str):  # a plain URL (e.g. a closed port)
                urls[name] = script
                continue
            upstream = await ScriptedUpstream(name, script).start()
            opened.append(upstream)
            upstreams[name] = upstream
            urls[name] = upstream.url
        gateway = await start_gateway(gateway_settings(urls, MODEL, **overrides), tokenizer=tokenizer())
        opened.append(gateway)
        return gateway, upstreams

    yield make
    for item in reversed(opened):
        await item.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url, timeout=20)


async def raw_post(url: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, CIMultiDict, bytes]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body, headers=headers) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"model": MODEL, "prompt": "hello"}),
    ("/v1/completions", {"model": MODEL, "prompt": "hello", "stream": True}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": True}),
])
async def test_answers_are_relayed_byte_for_byte(fleet, path, body):
    gateway, upstreams = await fleet({"a": Script(chunks=5, delay_s=0.01)})
    direct = await raw_post(upstreams["a"].url, path, body)
    relayed = await raw_post(gateway.url, path, body)
    assert relayed[0] == direct[0] == 200
    assert relayed[2] == direct[2]
    assert relayed[1]["Content-Type"].split(";")[0] == direct[1]["Content-Type"].split(";")[0]
    await assert_nothing_in_flight(gateway)


async def test_openai_client_reads_relayed_streams_and_answers(fleet):
    gateway, _ = await fleet({"a": Script(chunks=4)})
    answer = await client(gateway.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert answer.choices[0].message.content == "a-0 a-1 a-2 a-3 "
    stream = await client(gateway.url).completions.create(model=MODEL, prompt="x", stream=True)
    assert [chunk.choices[0].text async for chunk in stream] == ["a-0 ", "a-1 ", "a-2 ", "a-3 "]


async def test_refused_connection_is_retried_on_the_next_instance(fleet):
    # Round robin puts the dead instance first for every other request; all must still succeed.
    gateway, upstreams = await fleet(
        {"dead": closed_port_url(), "alive": Script()},
        dispatch_policy="round_robin", health_check_failures_to_eject=100,
    )
    for _ in range(4):
        answer = await client(gateway.url).completions.create(model=MODEL, prompt="hello")
        assert answer.choices[0].text.startswith("alive-0")
    assert len(upstreams["alive"].seen) == 4
    assert counter_value(gateway, "kvgate_forward_retries_total", instance="dead") == 2
    await assert_nothing_in_flight(gateway)


async def test_5xx_before_the_first_byte_is_retried_elsewhere(fleet):
    gateway, upstreams = await fleet({"broken": Script(status=500), "good": Script()},
                                     dispatch_policy="round_robin")
    for stream in (False, True, False, True):
        status, _, body = await raw_post(gateway.url, "/v1/completions",
                                         {"model": MODEL, "prompt": "p", "stream": stream})
        assert status == 200 and b"good-0" in body
    assert len(upstreams["broken"].seen) == 2 and len(upstreams["good"].seen) == 4
    await assert_nothing_in_flight(gateway)


async def test_4xx_is_relayed_and_never_retried(fleet):
    gateway, upstreams = await fleet({"a": Script(status=400), "b": Script(status=400)})
    status, _, body = await raw_post(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p"})
    assert status == 400
    assert b"says 400" in body
    assert len(upstreams["a"].seen) + len(upstreams["b"].seen) == 1
    await assert_nothing_in_flight(gateway)


async def test_retries_stop_at_forward_retries_and_answer_502(fleet):
    scripts = {name: Script(status=503) for name in ("a", "b", "c", "d")}
    gateway, upstreams = await fleet(scripts, forward_retries=2)
    with pytest.raises(openai.APIStatusError) as caught:
        await client(gateway.url).completions.create(model=MODEL, prompt="p")
    assert caught.value.status_code == 502
    assert caught.value.body["type"] == "server_error"
    assert "no instance could answer" in caught.value.body["message"]
    # 1 + forward_retries attempts, each on a different instance.
    assert sorted(len(u.seen) for u in upstreams.values()) == [0, 1, 1, 1]
    await assert_nothing_in_flight(gateway)


async def test_failure_after_the_first_byte_ends_the_stream_with_an_error_event(fleet):
    gateway, upstreams = await fleet({"a": Script(chunks=6, die_after_chunks=2), "b": Script()},
                                     dispatch_policy="round_robin")
    received = []
    stream = await client(gateway.url).completions.create(model=MODEL, prompt="p", stream=True)
    with pytest.raises(openai.APIError, match="failed mid-stream"):
        async for chunk in stream:
            received.append(chunk.choices[0].text)
    assert received == ["a-0 ", "a-1 "]
    assert upstreams["b"].seen == []  # bytes were already sent: no retry
    await assert_nothing_in_flight(gateway)


async def test_client_hang_up_cancels_upstream_and_releases_the_account(fleet):
    gateway, upstreams = await fleet({"a": Script(chunks=200, delay_s=0.02)})
    stream = await client(gateway.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], stream=True)
    async for chunk in stream:
        if chunk.choices[0].delta.content == "a-2 ":
            break
    await stream.close()
    await asyncio.wait_for(_until(lambda: upstreams["a"].cancelled == 1), 5)
    assert upstreams["a"].open_streams == 0
    await assert_nothing_in_flight(gateway)
    assert counter_value(gateway, "kvgate_requests_total", route="/v1/chat/completions", status="499") == 1


async def test_inflight_gauges_read_the_account_while_a_stream_runs(fleet):
    gateway, upstreams = await fleet({"a": Script(chunks=3, delay_s=0.5)})
    body = {"model": MODEL, "prompt": "some prompt", "stream": True}
    async with aiohttp.ClientSession() as session:
        # The gateway answers its head with the first token: meanwhile the request awaits it (0.5 s).
        answer = asyncio.create_task(session.post(gateway.url + "/v1/completions", json=body))
        await _until(lambda: upstreams["a"].open_streams == 1)
        requests, prefill_tokens = await inflight_gauges(gateway.url)
        assert requests == 1 and prefill_tokens > 0
        async with await answer as response:
            assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")
            assert await inflight_gauges(gateway.url) == (1.0, 0.0)  # prefill done, still in flight
    await assert_nothing_in_flight(gateway)


async def test_hang_up_before_the_first_byte_also_releases(fleet):
    gateway, upstreams = await fleet({"a": Script(chunks=3, delay_s=1.0)})
    task = asyncio.create_task(raw_post(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p", "stream": True}))
    await _until(lambda: upstreams["a"].open_streams == 1)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await asyncio.wait_for(_until(lambda: upstreams["a"].cancelled == 1), 5)
    await assert_nothing_in_flight(gateway)


async def test_request_id_is_propagated_or_generated(fleet):
    gateway, upstreams = await fleet({"a": Script()})
    _, headers, _ = await raw_post(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p"},
                                   headers={"X-Request-Id": "rid-123", "Authorization": "Bearer engine-key"})
    assert headers["X-Request-Id"] == "rid-123"
    seen_headers = CIMultiDict(upstreams["a"].seen[0].headers)
    assert seen_headers["X-Request-Id"] == "rid-123"
    assert seen_headers["Authorization"] == "Bearer engine-key"
    _, headers, _ = await raw_post(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p", "stream": True})
    generated = headers["X-Request-Id"]
    assert len(generated) == 32 and CIMultiDict(upstreams["a"].seen[1].headers)["X-Request-Id"] == generated
    _, headers, _ = await raw_post(gateway.url, "/v1/completions", {"model": MODEL, "prompt": "p"})
    assert len(headers["X-Request-Id"]) == 32 and headers["X-Request-Id"] != generated
    # Errors carry it too.
    _, headers, _ = await raw_post(gateway.url, "/v1/completions", {"model": "nope", "prompt": "p"},
                                   headers={"X-Request-Id": "rid-err"})
    assert headers["X-Request-Id"] == "rid-err"


async def test_body_passes_through_or_carries_token_ids(fleet):
    gateway, upstreams = await fleet({"a": Script()})
    body = {"model": MODEL, "prompt": "hello world", "temperature": 0.3, "vendor_extension": {"x": [1]}}
    await raw_post(gateway.url, "/v1/completions", body)
    assert upstreams["a"].seen[0].body == body
    await gateway.close()

    gateway, upstreams = await fleet({"a": Script()}, forward_token_ids=True)
    await raw_post(gateway.url, "/v1/completions", body)
    assert upstreams["a"].seen[0].body == {**body, "prompt": tokenizer().encode("hello world")}


async def _until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)
