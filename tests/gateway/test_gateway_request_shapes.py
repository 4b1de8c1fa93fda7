"""Request shapes clients send and engines accept, through the gateway with the official openai client:
tools and other chat template inputs, image parts, batched completion prompts, n > 1."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from kvgate.config.settings import Settings
from tests.gateway_helpers import EmbeddedFleet, assert_nothing_in_flight, counter_value
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MODEL = "kvgate/mock-llm"
CHUNK = 16
SETTINGS = Settings(port=0, kvs_chunk_size=CHUNK, dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=0,
                    health_check_interval_s=60.0, stats_poll_interval_s=60.0)
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city today.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
QUESTION = "What is the weather in Lisbon, and should I take an umbrella for a walk along the river?"


@pytest.fixture
async def fleet():
    async with EmbeddedFleet(SETTINGS, {"e0": Settings(kvs_chunk_size=CHUNK)}) as running:
        yield running
        await assert_nothing_in_flight(running.gateway)


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


async def gateway_prompt_tokens(url: str, body: dict) -> int:
    """How many prompt tokens the gateway routes this body on (its /debug/schedule plan)."""
    async with aiohttp.ClientSession() as session, session.post(url + "/debug/schedule", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["num_prompt_tokens"]


async def test_tools_reach_the_gateways_chat_template_as_the_engines(fleet):
    messages = [{"role": "user", "content": QUESTION}]
    url = fleet.gateway.url
    answer = await client(url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3)
    with_tools = await gateway_prompt_tokens(url, {"model": MODEL, "messages": messages, "tools": TOOLS})
    without = await gateway_prompt_tokens(url, {"model": MODEL, "messages": messages})
    assert answer.usage.prompt_tokens == with_tools > without
    # The engine renders with the same inputs: the gateway's keys for the repeat are the engine's blocks.
    await fleet.flushed()
    again = await client(url).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=3,
                                                      extra_body={"chat_template_kwargs": {"unused_flag": True}})
    assert again.usage.prompt_tokens_details.cached_tokens == with_tools // CHUNK * CHUNK
    assert counter_value(fleet.gateway, "kvgate_hit_comparisons_total", instance="e0", outcome="agree") == 2
    assert counter_value(fleet.gateway, "kvgate_predicted_cached_tokens_total", instance="e0") == \
        with_tools // CHUNK * CHUNK


async def test_image_parts_are_routed_on_their_text(fleet):
    text_only = [{"role": "user", "content": [{"type": "text", "text": "Describe this picture."}]}]
    with_image = [{"role": "user", "content": [
        {"type": "text", "text": "Describe this picture."},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}},
    ]}]
    answer = await client(fleet.gateway.url).chat.completions.create(model=MODEL, messages=with_image, max_tokens=4)
    assert answer.choices[0].finish_reason == "length" and answer.choices[0].message.content
    assert await gateway_prompt_tokens(fleet.gateway.url, {"model": MODEL, "messages": with_image}) == \
        await gateway_prompt_tokens(fleet.gateway.url, {"model": MODEL, "messages": text_only})


async def test_a_batched_prompt_is_served_in_order(fleet):
    prompts = ["The first prompt of the batch", "A second, different prompt"]
    api = client(fleet.gateway.url)
    whole = await api.completions.create(model=MODEL, prompt=prompts, max_tokens=5)
    assert [c.index for c in whole.choices] == [0, 1]
    singles = [await api.completions.create(model=MODEL, prompt=p, max_tokens=5) for p in prompts]
    assert [c.text for c in whole.choices] == [s.choices[0].text for s in singles]
    assert whole.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)

    streamed: dict[int, str] = {}
    async for chunk in await api.completions.create(model=MODEL, prompt=prompts, max_tokens=5, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
    assert streamed == {0: whole.choices[0].text, 1: whole.choices[1].text}

    ids = await api.completions.create(model=MODEL, prompt=[[11, 12, 13], [21, 22]], max_tokens=2)
    assert [c.index for c in ids.choices] == [0, 1] and ids.usage.prompt_tokens == 5


async def test_n_2_passes_through(fleet):
    api = client(fleet.gateway.url)
    messages = [{"role": "user", "content": QUESTION}]
    answer = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2)
    assert [c.index for c in answer.choices] == [0, 1]
    assert answer.choices[0].message.content != answer.choices[1].message.content
    indexes = set()
    async for chunk in await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, n=2,
                                                         stream=True):
        indexes |= {choice.index for choice in chunk.choices}
    assert indexes == {0, 1}
