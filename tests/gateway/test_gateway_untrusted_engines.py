"""Engines are not trusted: impossible numbers, endless or unfinished streams, odd hand-off parameters,
engines that refuse the gateway's credentials or never answer. Each must cost at most the one request
(never a 500 from the gateway's own code), with every account back to zero."""

from __future__ import annotations

import asyncio
import base64
import logging
import random
import socket

import aiohttp
import openai
import orjson
import pytest
from aiohttp import web

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.feedback.usage import reported_usage
from kvgate.gateway.fleet.engine_stats import parse_engine_stats
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.scheduler.types import EngineStats
from tests.engine_double import MODEL, EngineDouble, chunk, completion, stream, whole
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    gateway_records,
    gateway_settings,
    tokenizer,
    wait_until,
)
from tests.hung_engine import HungEngine
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

# Cache-aware over an (empty) in-process store: answers' usage is read and compared (hit_accounting.py).
TAPPED = {"dispatch_policy": "cache_aware", "cache_aware_scheduling_min_tokens": 0, "kvs_chunk_size": 16}
# Several full blocks: the store is asked, so usage is compared.
PROMPT = "the quick brown fox jumps over the lazy dog " * 8


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


async def start(upstreams: dict[str, str], **overrides):
    return await start_gateway(gateway_settings(upstreams, MODEL, **{**TAPPED, **overrides}),
                               kvs_index=EmbeddedKVSIndex(), tokenizer=tokenizer())


async def read_stream(url: str, **body) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "stream": True, **body}) as response:
        return response.status, await response.read()


def sse_errors(data: bytes) -> list[dict]:
    events = [line[6:] for line in data.split(b"\n") if line.startswith(b"data: {")]
    return [e["error"] for e in map(orjson.loads, events) if "error" in e]


@pytest.fixture
async def engine():
    double = await EngineDouble().start()
    yield double
    await double.close()


# --- usage numbers ---


def test_impossible_usage_numbers_are_refused_or_clamped():
    assert reported_usage({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 4}}).refused == ()
    negative = reported_usage({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": -3}})
    assert negative.cached_tokens is None and negative.refused == ("cached_tokens",)
    above = reported_usage({"prompt_tokens": 5, "prompt_tokens_details": {"cached_tokens": 9}})
    assert above.cached_tokens == 5 and above.refused == ("cached_tokens",)
    for prompt in (-1, 1 << 40):
        usage = reported_usage({"prompt_tokens": prompt, "prompt_tokens_details": {"cached_tokens": 1}})
        assert usage.refused == ("prompt_tokens",) and usage.cached_tokens is None
        assert 0 <= usage.prompt_tokens <= 1 << 31


BAD_USAGES = [
    {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": -3}},
    {"prompt_tokens": -7, "completion_tokens": -1},
    {"prompt_tokens": 5, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 1 << 50}},
]


async def test_negative_cached_tokens_never_fail_whole_answers_or_streams(engine, caplog):
    handle = await start({"e": engine.url}, access_log=True)
    try:
        with caplog.at_level(logging.INFO):
            for usage in BAD_USAGES:
                async def answer(request: web.Request, body: dict, usage=usage) -> web.StreamResponse:
                    if body.get("stream"):
                        return await stream(request, [chunk("a"), chunk(choices=False, usage=usage),
                                                      b"data: [DONE]\n\n"])
                    return await whole(completion(usage))

                engine.answer = answer
                answered = await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
                assert answered.choices[0].text == "ok"
                status, data = await read_stream(handle.url)
                assert status == 200 and not sse_errors(data) and data.endswith(b"data: [DONE]\n\n")
                # The usage chunk the gateway asked for on the client's behalf is still removed.
                assert b'"usage"' not in data
        refused = counter_value(handle, "kvgate_engine_values_refused_total", field="cached_tokens")
        assert refused == 4  # the first and third answers, whole and streamed
        assert counter_value(handle, "kvgate_engine_values_refused_total", field="prompt_tokens") == 2
        assert not [r for r in gateway_records(caplog) if r.levelno >= logging.ERROR]
        logged = [orjson.loads(r.getMessage()) for r in caplog.records if r.name == "kvgate.access"]
        # Whole answers and streams alternate; a negative completion count is not logged as one.
        assert [line["completion_tokens"] for line in logged if line["status"] == 200][::2] == [1, None, 1]
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


def test_scraped_gauges_that_are_not_possible_are_left_out():
    refused: list[str] = []
    text = ("vllm:num_requests_running NaN\nvllm:num_requests_waiting -4\nvllm:kv_cache_usage_perc 3\n"
            "vllm:num_requests_running{rank=\"1\"} 2\nvllm:num_requests_waiting{rank=\"1\"} +Inf\n")
    assert parse_engine_stats(text, refused.append) == EngineStats(2, 0, 1.0)
    assert sorted(refused) == ["vllm:num_requests_running", "vllm:num_requests_waiting",
                               "vllm:num_requests_waiting"]


async def test_the_stats_poller_counts_refused_gauges(engine):
    engine.metrics_text = "vllm:num_requests_running -3\nvllm:num_requests_waiting 1\n"
    handle = await start({"e": engine.url}, stats_poll_interval_s=0.05)
    try:
        await wait_until(lambda: counter_value(handle, "kvgate_engine_values_refused_total",
                                               field="vllm:num_requests_running") >= 1)
        answered = await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
        assert answered.choices[0].text == "ok"
    finally:
        await handle.close()


# --- SSE framing ---


async def test_an_event_that_never_ends_fails_only_its_stream(engine):
    async def endless(request: web.Request, body: dict) -> web.StreamResponse:
        pieces = [chunk("a"), b"data: {"] + [b"x" * 16384] * 40  # 640 KB, never a blank line
        return await stream(request, pieces)

    engine.answer = endless
    handle = await start({"e": engine.url}, max_sse_event_bytes=64 * 1024)
    try:
        status, data = await read_stream(handle.url)
        assert status == 200
        assert [e["code"] for e in sse_errors(data)] == ["upstream_event_too_large"]
        assert data.startswith(chunk("a")) and data.endswith(b"data: [DONE]\n\n") and b"xxxx" not in data
        assert counter_value(handle, "kvgate_requests_total", route="/v1/completions", status="stream_error") == 1
        engine.answer = EngineDouble.answer  # the next stream is whole again
        assert sse_errors((await read_stream(handle.url))[1]) == []
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


@pytest.mark.parametrize("tail", [b"", b'data: {"partial'], ids=["between-events", "mid-event"])
async def test_a_stream_ended_without_done_reaches_the_client_as_an_error(engine, tail):
    async def crashed(request: web.Request, body: dict) -> web.StreamResponse:
        return await stream(request, [chunk("a"), chunk("b"), tail])

    engine.answer = crashed
    handle = await start({"e": engine.url})
    try:
        status, data = await read_stream(handle.url)
        assert status == 200 and data.startswith(chunk("a") + chunk("b"))
        assert [e["code"] for e in sse_errors(data)] == ["upstream_stream_incomplete"]
        assert b"partial" not in data and data.endswith(b"data: [DONE]\n\n")
        assert counter_value(handle, "kvgate_requests_total", route="/v1/completions", status="stream_error") == 1
        with pytest.raises(openai.APIError, match="without data: \\[DONE\\]"):
            async for _ in await client(handle.url).completions.create(model=MODEL, prompt=PROMPT, stream=True):
                pass
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_crlf_framed_streams_and_split_separators_still_end_cleanly(engine):
    events = chunk("a").replace(b"\n\n", b"\r\n\r\n") + chunk("b") + b"data: [DONE]\r\n\r\n"

    async def byte_by_byte(request: web.Request, body: dict) -> web.StreamResponse:
        return await stream(request, [events[i:i + 1] for i in range(len(events))])

    engine.answer = byte_by_byte
    handle = await start({"e": engine.url})
    try:
        status, data = await read_stream(handle.url)
        assert status == 200 and data == events
    finally:
        await handle.close()


# --- credentials and refusals ---


async def test_credentials_in_an_instance_url_are_sent_with_requests(engine):
    engine.required_authorization = "Basic " + base64.b64encode(b"user:s3cret").decode()
    url = engine.url.replace("http://", "http://user:s3cret@")
    # An engine key is configured too: the instance's own credentials win for that instance.
    handle = await start({"e": url}, health_check_interval_s=0.05, engine_api_key="fleet-key")
    try:
        await asyncio.sleep(0.2)  # a few health checks (sent with the same credentials) went by
        assert handle.app[GATEWAY].registry.get("e").healthy
        answered = await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
        assert answered.choices[0].text == "ok"
        assert engine.seen[-1][0]["Authorization"] == engine.required_authorization
    finally:
        await handle.close()


async def test_an_engine_refusing_the_gateways_key_is_failed_over_and_ejected():
    bad = await EngineDouble(required_authorization="Bearer another-key").start()
    good = await EngineDouble(required_authorization="Bearer fleet-key").start()
    handle = await start({"bad": bad.url, "good": good.url}, dispatch_policy="round_robin",
                         engine_api_key="fleet-key", outlier_consecutive_failures=2)
    try:
        for _ in range(6):
            answered = await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
            assert answered.choices[0].text == "ok"
        assert counter_value(handle, "kvgate_outlier_ejections_total", instance="bad") == 1
        assert counter_value(handle, "kvgate_forward_retries_total", instance="bad") == 2
        assert not handle.app[GATEWAY].registry.get("bad").healthy
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await bad.close()
        await good.close()


async def test_a_clients_own_key_refused_by_the_engine_is_the_clients_401(engine):
    engine.required_authorization = "Bearer the-clients-key"  # the gateway passes the client's header on
    handle = await start({"e": engine.url}, outlier_consecutive_failures=1)
    try:
        with pytest.raises(openai.AuthenticationError):
            await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
        assert handle.app[GATEWAY].registry.get("e").healthy
        assert counter_value(handle, "kvgate_forward_retries_total", instance="e") == 0
    finally:
        await handle.close()


# --- prefill/decode ---

GOOD_PARAMS = {"do_remote_prefill": True, "remote_engine_id": "p-engine", "remote_block_ids": [1, 2, 3],
               "remote_host": "127.0.0.1", "remote_port": 5600}


async def pd_gateway(prefill: EngineDouble, decode: EngineDouble, **overrides):
    instances = [InstanceConfig(id="p", url=prefill.url, model=MODEL, role="prefill"),
                 InstanceConfig(id="d", url=decode.url, model=MODEL, role="decode")]
    settings = Settings(port=0, health_check_interval_s=60.0, stats_poll_interval_s=60.0, pd_protocol="vllm",
                        instances=instances, **{**TAPPED, **overrides})
    return await start_gateway(settings, kvs_index=EmbeddedKVSIndex(), tokenizer=tokenizer())


def prefill_answering(params: object, usage: object = None):
    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        return await whole(completion(usage, kv_transfer_params=params))
    return answer


async def test_the_access_log_names_both_instances_of_a_pair(caplog):
    prefill, decode = await EngineDouble().start(), await EngineDouble().start()
    prefill.answer = prefill_answering(GOOD_PARAMS, {"prompt_tokens": 3, "prompt_tokens_details":
                                                     {"cached_tokens": -1}})
    handle = await pd_gateway(prefill, decode, access_log=True)
    try:
        with caplog.at_level(logging.INFO, logger="kvgate.access"):
            answered = await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
        assert answered.choices[0].text == "ok"
        assert decode.seen[-1][1]["kv_transfer_params"] == GOOD_PARAMS
        line = orjson.loads(next(r.getMessage() for r in caplog.records if r.name == "kvgate.access"))
        assert (line["instance"], line["prefill_instance"], line["status"]) == ("d", "p", 200)
        # The prefill's impossible cached tokens were refused, not fed to a counter.
        assert counter_value(handle, "kvgate_engine_values_refused_total", field="cached_tokens") == 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await prefill.close()
        await decode.close()


@pytest.mark.parametrize("params", [
    {**GOOD_PARAMS, "remote_port": -1},
    {**GOOD_PARAMS, "remote_port": "5600"},
    {**GOOD_PARAMS, "remote_block_ids": [1, -2]},
    {**GOOD_PARAMS, "remote_block_ids": "1,2"},
    {**GOOD_PARAMS, "remote_host": "h" * (2 * 1024 * 1024)},
    [1, 2],
    "params",
], ids=["negative-port", "string-port", "negative-block", "string-blocks", "oversized", "list", "string"])
async def test_kv_transfer_params_no_connector_sends_are_refused(params):
    prefill, decode = await EngineDouble().start(), await EngineDouble().start()
    prefill.answer = prefill_answering(params)
    handle = await pd_gateway(prefill, decode)
    try:
        with pytest.raises(openai.APIStatusError) as failed:
            await client(handle.url).completions.create(model=MODEL, prompt=PROMPT)
        assert failed.value.status_code == 502 and failed.value.body["code"] == "upstream_unavailable"
        assert decode.seen == []
        assert counter_value(handle, "kvgate_engine_values_refused_total", field="kv_transfer_params") >= 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await prefill.close()
        await decode.close()


# --- engines that never answer ---


class StalledAccept:
    """A hung engine whose accept queue is full until the test says: connections to it stay in their
    handshake, as to a host that drops SYNs under load, then are accepted and never answered."""

    def __init__(self) -> None:
        self.generations = 0
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(0)
        self._listener.setblocking(False)
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        # Linux admits backlog + 1 connections to the accept queue; the next SYNs are dropped.
        self._fillers = [socket.create_connection(self._listener.getsockname(), timeout=2)]
        self._server: asyncio.Server | None = None

    async def accept(self) -> None:
        async def swallow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while data := await reader.read(65536):
                self.generations += data.count(b"POST /v1/")

        self._server = await asyncio.start_server(swallow, sock=self._listener)

    async def close(self) -> None:
        for filler in self._fillers:
            filler.close()
        if self._server is not None:
            self._server.close()
        else:
            self._listener.close()


async def test_a_request_still_connecting_when_its_instance_is_ejected_fails_over(engine):
    stalled = StalledAccept()
    handle = await start_gateway(gateway_settings({"a-stalled": stalled.url, "b-good": engine.url}, MODEL,
                                                  **TAPPED), kvs_index=EmbeddedKVSIndex(), tokenizer=tokenizer())
    try:
        async with aiohttp.ClientSession() as session, session.post(
                handle.url + "/debug/schedule", json={"model": MODEL, "prompt": PROMPT}) as response:
            assert (await response.json())["ranking"][0] == "a-stalled"  # the tie-break's first
        request = asyncio.create_task(client(handle.url).completions.create(model=MODEL, prompt=PROMPT))
        await asyncio.sleep(0.3)  # routed, its connection in the handshake
        registry = handle.app[GATEWAY].registry
        registry.eject(registry.get("a-stalled"))  # as failed health checks do
        await stalled.accept()  # the handshake completes after the ejection (a SYN retransmission)
        answered = await asyncio.wait_for(request, 10)
        assert answered.choices[0].text == "ok" and engine.seen
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await stalled.close()


async def test_a_whole_answer_waits_on_a_silent_engine_only_as_long_as_the_operator_says(caplog):
    hung = await HungEngine().start()
    handle = await start({"hung": hung.url, "gone": closed_port_url()}, upstream_whole_answer_timeout_s=0.3)
    try:
        with pytest.raises(openai.APIStatusError) as failed, caplog.at_level(logging.WARNING):
            await asyncio.wait_for(client(handle.url).completions.create(model=MODEL, prompt=PROMPT), 10)
        assert failed.value.status_code == 502
        # The log names the limit that was reached (the whole-answer one, not the streams' first-byte one).
        assert any("no first byte within 0.3 s" in r.getMessage() for r in gateway_records(caplog))
        await wait_until(lambda: hung.generations == 1 and hung.open == 0)  # its connection was closed
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await hung.close()


# --- fuzz: random usage numbers, SSE framing and kv_transfer_params shapes (seeded, bounded) ---

FUZZ_CASES = 120
NUMBERS = [b"0", b"3", b"-1", b"-9223372036854775808", b"9223372036854775807", b"18446744073709551616",
           b"1e400", b"-0.5", b"2.0", b'"12"', b"null", b"true", b"[]", b"{}"]


def rss_bytes() -> int:
    with open("/proc/self/status") as status:
        kilobytes = next(line for line in status if line.startswith("VmRSS:")).split()[1]
    return int(kilobytes) * 1024


def fuzzed_usage(rng: random.Random) -> bytes:
    """A usage object as JSON text, numbers drawn from NUMBERS (some no JSON encoder would write)."""
    def number() -> bytes:
        return rng.choice(NUMBERS) if rng.random() < 0.7 else str(rng.randrange(-10**6, 10**6)).encode()

    details = b',"prompt_tokens_details":{"cached_tokens":%s}' % number() if rng.random() < 0.8 else b""
    return b'{"prompt_tokens":%s,"completion_tokens":%s%s}' % (number(), number(), details)


def fuzzed_stream(rng: random.Random, max_event_bytes: int) -> list[bytes]:
    separator = rng.choice((b"\n\n", b"\r\n\r\n"))
    events = []
    for index in range(rng.randrange(0, 6)):
        roll = rng.random()
        if roll < 0.6:
            events.append(chunk(f"t{index}").replace(b"\n\n", separator))
        elif roll < 0.8:
            events.append(b'data: {"id":"x","object":"text_completion","choices":[],"usage":'
                          + fuzzed_usage(rng) + b"}" + separator)
        elif roll < 0.9:
            events.append(b": keep-alive" + separator)
        else:
            events.append(b"data: " + bytes(rng.getrandbits(8) for _ in range(rng.randrange(1, 200))) + separator)
    ending = rng.random()
    if ending < 0.6:
        events.append(b"data: [DONE]" + separator)
    elif ending < 0.75:
        events.append(b'data: {"unterminated')
    elif ending < 0.85:
        events.append(b"data: " + b"y" * (max_event_bytes + rng.randrange(1, 50000)))
    data = b"".join(events)
    pieces, start = [], 0
    while start < len(data):
        size = rng.choice((1, 7, 64, 1500, 70000))
        pieces.append(data[start:start + size])
        start += size
    return pieces


def fuzzed_answer(rng: random.Random, max_event_bytes: int):
    roll = rng.random()
    status = 200 if roll < 0.8 else rng.choice((400, 401, 404, 429, 500, 503))
    pieces = fuzzed_stream(rng, max_event_bytes)
    usage = fuzzed_usage(rng)

    async def answer(request: web.Request, body: dict) -> web.StreamResponse:
        if status != 200:
            return await whole({"error": {"message": "fuzzed", "type": "x", "param": None, "code": status}},
                               status=status)
        if body.get("stream"):
            return await stream(request, pieces)
        return await whole(orjson.dumps(completion()).replace(b'"model"', b'"usage":' + usage + b',"model"', 1))
    return answer


def assert_openai_error(status: int, payload: bytes) -> None:
    error = orjson.loads(payload)["error"]
    assert set(error) >= {"message", "type", "param", "code"}, (status, payload[:300])


async def test_fuzzed_engine_answers_cost_at_most_their_own_request(engine, caplog):
    rng = random.Random(1124)
    max_event_bytes = 32 * 1024
    handle = await start({"e": engine.url}, max_sse_event_bytes=max_event_bytes, access_log=True)
    rss_before = rss_bytes()
    try:
        with caplog.at_level(logging.INFO):
            async with aiohttp.ClientSession() as session:
                for n in range(FUZZ_CASES):
                    engine.answer = fuzzed_answer(rng, max_event_bytes)
                    streamed = rng.random() < 0.6
                    async with session.post(handle.url + "/v1/completions", json={
                            "model": MODEL, "prompt": PROMPT, "stream": streamed}) as response:
                        status, payload = response.status, await response.read()
                    assert status != 500, payload[:300]
                    if status >= 400:
                        assert_openai_error(status, payload)
                    elif streamed:
                        # Whole, or ended by the gateway with an error event: either way [DONE] is last.
                        assert payload.rstrip().endswith(b"data: [DONE]"), payload[-200:]
                    if n % 20 == 0:
                        async with session.get(handle.url + "/livez", timeout=aiohttp.ClientTimeout(total=5)) as r:
                            assert r.status == 200
        await assert_nothing_in_flight(handle)
        process_lines = [r for r in gateway_records(caplog) if r.name != "kvgate.access"]
        assert not [r for r in process_lines if r.exc_info or r.levelno >= logging.ERROR]
        assert len(process_lines) <= FUZZ_CASES  # at most one line per failed request, none per byte
        assert counter_value(handle, "kvgate_requests_total", route="/v1/completions", status="stream_error") > 0
        assert counter_value(handle, "kvgate_engine_values_refused_total", field="cached_tokens") > 0
        assert rss_bytes() - rss_before < 150 * 1024 * 1024
    finally:
        await handle.close()


def fuzzed_params(rng: random.Random) -> object:
    def value(depth: int = 0) -> object:
        roll = rng.random()
        if roll < 0.3 or depth > 2:
            return rng.choice((None, True, -1, 0, 5600, 70000, 1.5, "", "x" * rng.randrange(0, 100)))
        if roll < 0.6:
            return [value(depth + 1) for _ in range(rng.randrange(0, 5))]
        return {rng.choice(("remote_port", "remote_block_ids", "remote_host", "k")): value(depth + 1)
                for _ in range(rng.randrange(0, 4))}

    if rng.random() < 0.3:
        return GOOD_PARAMS
    if rng.random() < 0.5:
        return {**GOOD_PARAMS, rng.choice(("remote_port", "remote_block_ids", "remote_host")): value()}
    return value()


async def test_fuzzed_kv_transfer_params_never_reach_the_decode_unchecked(caplog):
    rng = random.Random(2026)
    prefill, decode = await EngineDouble().start(), await EngineDouble().start()
    # Outlier ejection off: the lone prefill instance stays in, to be fed every shape.
    handle = await pd_gateway(prefill, decode, outlier_consecutive_failures=0)
    try:
        with caplog.at_level(logging.WARNING):
            outcomes = set()
            for _ in range(60):
                params = fuzzed_params(rng)
                prefill.answer = prefill_answering(params, orjson.Fragment(fuzzed_usage(rng)))
                seen = len(decode.seen)
                async with aiohttp.ClientSession() as session, session.post(
                        handle.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT}) as response:
                    status, payload = response.status, await response.read()
                assert status in (200, 502), payload[:300]
                outcomes.add(status)
                if status == 502:
                    assert_openai_error(status, payload)
                    assert len(decode.seen) == seen
                else:
                    sent = decode.seen[-1][1]["kv_transfer_params"]
                    assert sent == params and isinstance(sent, dict)
                    port = sent.get("remote_port")
                    assert port is None or type(port) is int and 1 <= port <= 65535, port
        assert outcomes == {200, 502}  # the fuzz reached both
        assert not [r for r in gateway_records(caplog) if r.exc_info or r.levelno >= logging.ERROR]
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await prefill.close()
        await decode.close()
