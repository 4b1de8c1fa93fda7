"""kvgate in front of two real vLLM engines: tokens, load, hang-ups, over-long prompts, engine deaths.

The two engines start once for the module. The last tests kill them, so they run last, in order.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Iterator

import aiohttp
import openai
import orjson
import pytest

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.doctor.probes import PROBE_CHAT, PROBE_TEXT, PROBE_TOOLS
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.chat_inputs import chat_template_inputs
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import assert_nothing_in_flight, wait_until
from tests.otlp_receiver import OTLPReceiver
from tests.vllm.fleet import MODEL, module_fleet, wait_engine_idle, wait_engines_hold

MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def trace_receiver() -> Iterator[OTLPReceiver]:
    """An OTLP receiver the engines export their spans to from their start: a module's fixture, so
    it runs on an event loop of its own, in a thread."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="otlp receiver", daemon=True)
    thread.start()
    receiver = asyncio.run_coroutine_threadsafe(OTLPReceiver().start(grpc_too=False), loop).result(30)
    yield receiver
    asyncio.run_coroutine_threadsafe(receiver.close(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


@pytest.fixture(scope="module")
def engines(engine_venv, model_dir, tmp_path_factory, trace_receiver):
    specs = [{"max_model_len": MAX_MODEL_LEN, "otlp_traces_endpoint": trace_receiver.http_endpoint}
             for _ in range(2)]
    with module_fleet(engine_venv, model_dir, tmp_path_factory.mktemp("vllm-serving"), specs) as fleet:
        yield fleet


def settings_for(engines, **overrides) -> Settings:
    values = {
        "port": 0,
        "dispatch_policy": "round_robin",
        "health_check_interval_s": 0.5,
        "stats_poll_interval_s": 60.0,
        "instances": [InstanceConfig(id=f"e{i}", url=e.url, model=MODEL) for i, e in enumerate(engines)],
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def gateway(engines, engine_tokenizer):
    handle = await start_gateway(settings_for(engines), tokenizer=engine_tokenizer)
    yield handle
    await handle.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


async def engine_tokenize(engine, body: dict) -> list[int]:
    async with aiohttp.ClientSession() as session, session.post(engine.url + "/tokenize", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["tokens"]


async def test_token_ids_equal_the_engines_tokenize(engines, tokenizer_service):
    engine = engines[0]
    texts = [PROBE_TEXT, "plain ascii words", "   leading spaces and\ttabs\n\nnew lines", "émoji 🚀 and 中文"]
    for text in texts:
        theirs = await engine_tokenize(engine, {"model": MODEL, "prompt": text})
        assert tokenizer_service.encode_prompt_sync(text) == theirs, text
    chats = [
        {"model": MODEL, "messages": PROBE_CHAT, "add_generation_prompt": True},
        {"model": MODEL, "messages": PROBE_CHAT, "tools": PROBE_TOOLS, "add_generation_prompt": True},
        {"model": MODEL, "messages": PROBE_CHAT[:2], "add_generation_prompt": False},
    ]
    for body in chats:
        theirs = await engine_tokenize(engine, body)
        assert tokenizer_service.encode_chat_sync(body["messages"], chat_template_inputs(body)) == theirs


async def test_account_reconciles_with_the_engines_load(engines, engine_tokenizer):
    """While streams run, kvgate's in-flight count per instance equals the engine's running + waiting."""
    # Probes time out after their interval: a busy engine on one CPU core answers /health and
    # /metrics in up to a second or so, which is not the failure the other tests eject for.
    gateway = await start_gateway(settings_for(engines, stats_poll_interval_s=1.0, health_check_interval_s=3.0),
                                  tokenizer=engine_tokenizer)
    try:
        await _reconcile(engines, gateway)
    finally:
        await gateway.close()


async def _reconcile(engines, gateway) -> None:
    account = gateway.app[GATEWAY].account
    api = client(gateway.url)
    # As long as the context allows: the engines count a request only while they generate it, and an
    # idle machine finished 2,000 tokens before the comparison was made.
    streams = [
        await api.completions.create(model=MODEL, prompt=[1000 + i] * 300, max_tokens=MAX_MODEL_LEN - 310,
                                     stream=True, extra_body={"ignore_eos": True})
        for i in range(6)
    ]
    try:
        for stream in streams:
            await stream.__anext__()  # every request is running on its engine
        held = await wait_engines_hold(engines, 6)
        for index, engine_held in enumerate(held):
            instance = f"e{index}"
            assert account.inflight(instance)[0] == engine_held
            # The scraper reads the same figures from the engine's metrics (vllm:num_requests_*).
            await wait_until(lambda i=instance, n=engine_held: account.load(i).num_requests == n and
                             account.rows.engine(i) is not None and
                             account.rows.engine(i).num_running + account.rows.engine(i).num_waiting == n,
                             timeout_s=15.0)
    finally:
        for stream in streams:
            await stream.close()
    for engine in engines:
        await wait_engine_idle(engine)
    await assert_nothing_in_flight(gateway)


async def test_client_hang_up_makes_the_engine_abort(engines, gateway):
    stream = await client(gateway.url).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "count forever"}], max_tokens=3000, stream=True,
        extra_body={"ignore_eos": True})
    for _ in range(5):
        await stream.__anext__()
    await wait_engines_hold(engines, 1)
    await stream.close()
    for engine in engines:
        await wait_engine_idle(engine, timeout_s=5.0)
    await assert_nothing_in_flight(gateway)


async def test_prompt_over_the_engines_context_is_one_openai_400(engines, gateway):
    """The gateway learns max_model_len from /v1/models and answers every prompt form the same way."""
    api = client(gateway.url)
    long_ids = [1000 + i % 500 for i in range(MAX_MODEL_LEN + 10)]
    long_text = " ".join(["word"] * (MAX_MODEL_LEN + 10))
    calls = [
        lambda: api.completions.create(model=MODEL, prompt=long_ids, max_tokens=4),
        lambda: api.completions.create(model=MODEL, prompt=long_text, max_tokens=4),
        lambda: api.completions.create(model=MODEL, prompt=long_text, max_tokens=4, stream=True),
        lambda: api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": long_text}],
                                            max_tokens=4),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as caught:
            await call()
        error = caught.value.body
        assert error["type"] == "invalid_request_error" and error["code"] == "context_length_exceeded", error
        assert str(MAX_MODEL_LEN) in error["message"]
    await assert_nothing_in_flight(gateway)


async def test_the_engines_span_joins_the_gateways_trace(engines, engine_tokenizer, trace_receiver):
    """kvgate passes its forward span's traceparent to the engine: vLLM's own request span is that
    span's child, in the same trace, in the same receiver."""
    gateway = await start_gateway(settings_for(engines, otlp_traces_endpoint=trace_receiver.http_endpoint),
                                  tokenizer=engine_tokenizer)
    try:
        await client(gateway.url).completions.create(model=MODEL, prompt="a traced request", max_tokens=4)
    finally:
        await gateway.close()  # flushes kvgate's spans
    forward = [s for s in trace_receiver.spans if s.service == "kvgate" and s.name == "kvgate.forward"]
    assert len(forward) == 1, [s.name for s in trace_receiver.spans]
    await wait_until(lambda: any(s.trace_id == forward[0].trace_id for s in trace_receiver.spans
                                 if s.service == "vllm"), timeout_s=30.0)  # vLLM exports in batches
    [engine_span] = [s for s in trace_receiver.spans if s.service == "vllm" and s.trace_id == forward[0].trace_id]
    assert engine_span.parent_span_id == forward[0].span_id, engine_span


async def test_engine_killed_before_the_first_byte_is_retried_elsewhere(engines, gateway):
    """e1 is frozen, gets its requests, then dies: they are answered by e0."""
    victim = engines[1]
    os.killpg(victim.process.pid, signal.SIGSTOP)
    api = client(gateway.url)
    calls = [asyncio.create_task(api.completions.create(model=MODEL, prompt=[2000 + i] * 50, max_tokens=4))
             for i in range(2)]
    account = gateway.app[GATEWAY].account
    await wait_until(lambda: account.inflight("e1")[0] == 1, timeout_s=10)
    victim.kill()
    answers = await asyncio.gather(*calls)
    assert all(answer.choices[0].text is not None for answer in answers)
    await assert_nothing_in_flight(gateway)


async def test_engine_killed_mid_stream_ends_with_an_error_event(engines, engine_tokenizer):
    survivor = engines[0]
    handle = await start_gateway(settings_for([survivor]), tokenizer=engine_tokenizer)
    try:
        body = {"model": MODEL, "prompt": [3000] * 40, "max_tokens": 3000, "stream": True, "ignore_eos": True}
        events: list[bytes] = []
        async with aiohttp.ClientSession() as session, session.post(handle.url + "/v1/completions",
                                                                    json=body) as response:
            assert response.status == 200
            async for line in response.content:
                if line.startswith(b"data: "):
                    events.append(line[6:].strip())
                    if len(events) == 5:
                        survivor.kill()
        assert events[-1] == b"[DONE]"
        error = orjson.loads(events[-2])["error"]
        assert error["type"] and error["message"], error
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
