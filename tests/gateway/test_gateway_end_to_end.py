"""The gateway in front of real mock engines, driven by the official openai client."""

from __future__ import annotations

import asyncio

import openai
import pytest

from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from tests.gateway_helpers import (
    assert_hang_up_released,
    assert_nothing_in_flight,
    gateway_settings,
    read_events,
    tokenizer,
)
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

CONFIG = MockEngineConfig(time_scale=0.05)
MODEL = CONFIG.model
# Fields that legitimately differ between two calls: ids and clocks.
_VOLATILE = {"id", "created", "system_fingerprint"}


@pytest.fixture
async def engines():
    """Two identical engines: one behind the gateway, one called directly (same fresh cache state)."""
    handles = [await start_mock_engine(CONFIG, tokenizer=TokenizerService(tokenizer())) for _ in range(2)]
    yield handles
    for handle in handles:
        await handle.close()


@pytest.fixture
async def gateway(engines):
    handle = await start_gateway(gateway_settings({"e0": engines[0].url}, MODEL), tokenizer=tokenizer())
    yield handle
    await handle.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


def stable(obj) -> dict:
    return {k: v for k, v in obj.model_dump().items() if k not in _VOLATILE}


CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three rivers."}]


async def test_non_streaming_answers_match_the_engine_called_directly(engines, gateway):
    via, direct = client(gateway.url), client(engines[1].url)
    for call in (
        lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12),
        lambda c: c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=9),
        lambda c: c.completions.create(model=MODEL, prompt=[101, 202, 303, 404], max_tokens=5),
    ):
        relayed, expected = await call(via), await call(direct)
        assert stable(relayed) == stable(expected)
        assert relayed.choices[0].finish_reason == "length"


async def test_streaming_answers_match_the_engine_called_directly(engines, gateway):
    async def chunks(c: openai.AsyncOpenAI) -> list[dict]:
        stream = await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True})
        return [stable(chunk) async for chunk in stream]

    relayed, expected = await chunks(client(gateway.url)), await chunks(client(engines[1].url))
    assert relayed == expected
    assert relayed[-1]["usage"]["completion_tokens"] == 20
    await assert_nothing_in_flight(gateway)


async def test_hang_up_mid_stream_frees_gateway_and_engine(engines, gateway):
    engine = engines[0].engine
    stream = await client(gateway.url).completions.create(model=MODEL, prompt="tell me a story", max_tokens=2000,
                                                          stream=True)
    await read_events(stream, 3)
    await stream.close()
    await assert_hang_up_released(gateway, engine)


async def test_200_concurrent_streams_complete_and_leave_nothing_in_flight(engines):
    handle = await start_gateway(gateway_settings({"e0": engines[0].url, "e1": engines[1].url}, MODEL),
                                 tokenizer=tokenizer())
    try:
        c = client(handle.url)

        async def one(i: int) -> int:
            stream = await c.completions.create(model=MODEL, prompt=f"request {i}: " + "context " * 40,
                                                max_tokens=8, stream=True)
            return sum([len(chunk.choices[0].text) > 0 async for chunk in stream if chunk.choices])

        counts = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(200))), timeout=120)
        assert all(count >= 1 for count in counts) and len(counts) == 200
        await assert_nothing_in_flight(handle)
        # Both engines took a share (least load spreads a burst).
        served = [e.engine.core.stats().prefix_cache_queries for e in engines]
        assert all(q > 0 for q in served)
    finally:
        await handle.close()
