"""The gateway with --kvs-backend conductor, end to end over real HTTP: mock engines, the official
openai client, and a conformance double of Mooncake's Conductor indexer (tests/conductor_double.py;
the service itself cannot be installed here) whose prefix table says which instance holds which part
of a prompt on which medium.

Instances have no kvs_endpoints: the indexer knows them by their ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from kvgate.commands.doctor import diagnose
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.engine_model import ServiceProfile
from kvgate.gateway.http.server import GatewayHandle, start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from tests.conductor_double import ConductorDouble
from tests.gateway_helpers import assert_nothing_in_flight, closed_port_url, tokenizer
from tests.openai_helpers import openai_client

pytestmark = [pytest.mark.usefixtures("close_openai_clients"), pytest.mark.timeout(120)]

CHUNK = 16
MODEL = "kvgate/mock-llm"


def conversation(topic: str, question: str) -> list[dict]:
    """A long shared system prompt per topic, then a varying question."""
    system = f"You are an expert on {topic}. " + " ".join(f"Fact {i} about {topic}." for i in range(40))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


@asynccontextmanager
async def fleet(indexer_url: str, **overrides) -> AsyncIterator[tuple[GatewayHandle, list, TokenizerService]]:
    base = Settings(kvs_chunk_size=CHUNK)
    engine_config = MockEngineConfig(time_scale=0.01, settings=base, profile=ServiceProfile().with_block_size(CHUNK))
    engines = [await start_mock_engine(engine_config, tokenizer=TokenizerService(tokenizer())) for _ in range(2)]
    settings = Settings(**{
        "port": 0, "health_check_interval_s": 60.0, "stats_poll_interval_s": 60.0,
        "kvs_backend": KVSBackendName.CONDUCTOR, "kvs_conductor_url": indexer_url, "kvs_chunk_size": CHUNK,
        "kvs_query_budget_ms": 2000, "cache_aware_scheduling_min_tokens": CHUNK,
        "instances": [InstanceConfig(id=f"e{i}", url=engine.url, model=MODEL) for i, engine in enumerate(engines)],
        **overrides,
    })
    gateway = await start_gateway(settings, tokenizer=tokenizer())
    service = TokenizerService(tokenizer())
    try:
        yield gateway, engines, service
    finally:
        await gateway.close()
        service.close()
        for engine in engines:
            await engine.close()


@pytest.fixture
async def conductor() -> AsyncIterator[ConductorDouble]:
    double = await ConductorDouble().start()
    yield double
    await double.close()


async def schedule(gateway: GatewayHandle, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(gateway.url + "/debug/schedule", json=body) as answer:
        assert answer.status == 200, await answer.text()
        return await answer.json()


def held_blocks(service: TokenizerService, topic: str) -> tuple[list[int], int]:
    """The warm-up prompt's ids and how many whole blocks of them a question shares."""
    ids = service.encode_chat_sync(conversation(topic, "warm-up"))
    return ids, len(ids) // CHUNK - 2  # keep clear of the question's tokens


async def test_cache_aware_routes_to_the_longest_prefix_the_indexer_reports(conductor):
    async with fleet(conductor.url, dispatch_policy="cache_aware") as (gateway, engines, service):
        held = {}
        for topic, longest, shorter in (("rivers", "e1", "e0"), ("volcanoes", "e0", "e1")):
            ids, blocks = held_blocks(service, topic)
            held[topic] = blocks
            conductor.store(longest, ids[: blocks * CHUNK], "gpu", model=MODEL, block_size=CHUNK)
            conductor.store(shorter, ids[: 2 * CHUNK], "cpu", model=MODEL, block_size=CHUNK)

        client = openai_client(gateway.url)
        for topic, expected in (("rivers", "e1"), ("volcanoes", "e0")):
            messages = conversation(topic, "Which is the longest?")
            plan = await schedule(gateway, {"model": MODEL, "messages": messages, "max_tokens": 4})
            asked = conductor.requests[-1]
            # The indexer was asked for the request's own token ids (its complete blocks), model and block size.
            prompt_ids = service.encode_chat_sync(messages)
            assert asked["token_ids"] == prompt_ids[: len(prompt_ids) // CHUNK * CHUNK]
            assert (asked["model"], asked["block_size"], asked["tenant_id"]) == (MODEL, CHUNK, "default")
            assert (plan["kvs_status"], plan["selected"]) == ("ok", expected)
            hits = {entry["id"]: entry["prefix_hit_tokens"] for entry in plan["instances"]}
            other = "e0" if expected == "e1" else "e1"
            assert hits == {expected: held[topic] * CHUNK, other: 2 * CHUNK}

            before = [engine.engine.core.stats().prefix_cache_queries for engine in engines]
            answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
            assert answer.choices[0].message.content
            after = [engine.engine.core.stats().prefix_cache_queries for engine in engines]
            assert [b != a for b, a in zip(before, after, strict=True)] == [expected == "e0", expected == "e1"]
        await client.close()
        await assert_nothing_in_flight(gateway)


async def test_conductor_prices_a_prefix_on_another_instances_cpu_tier_as_a_transfer(conductor):
    async with fleet(conductor.url, dispatch_policy="conductor") as (gateway, _, service):
        ids, blocks = held_blocks(service, "glaciers")
        conductor.store("e0", ids[: blocks * CHUNK], "cpu", model=MODEL, block_size=CHUNK)
        body = {"model": MODEL, "messages": conversation("glaciers", "How do they move?"), "max_tokens": 4}
        plan = await schedule(gateway, body)
        assert plan["kvs_status"] == "ok"
        by_id = {entry["id"]: entry for entry in plan["instances"]}
        # e0 holds the prefix itself; e1 would load it from e0's segment instead of computing it.
        assert (by_id["e0"]["local_hit_tokens"], by_id["e0"]["transfer_tokens"]) == (blocks * CHUNK, 0)
        assert (by_id["e1"]["local_hit_tokens"], by_id["e1"]["transfer_tokens"]) == (0, blocks * CHUNK)
        assert by_id["e1"]["transfer_s"] > 0
        assert plan["selected"] == "e0"  # same (empty) queues: the holder needs no transfer


async def test_the_disk_tier_is_a_transfer_for_every_instance_only_when_asked_for(conductor):
    for disk_tier in (False, True):
        async with fleet(conductor.url, dispatch_policy="conductor",
                         kvs_query_disk_tier=disk_tier) as (gateway, _, service):
            ids, blocks = held_blocks(service, "deltas")
            conductor.store("e0", ids[: blocks * CHUNK], "disk", model=MODEL, block_size=CHUNK)
            body = {"model": MODEL, "messages": conversation("deltas", "Where do they form?"), "max_tokens": 4}
            plan = await schedule(gateway, body)
            expected = blocks * CHUNK if disk_tier else 0
            for entry in plan["instances"]:
                # A block on disk is no instance's prefix cache: its holder loads it too.
                assert (entry["local_hit_tokens"], entry["transfer_tokens"]) == (0, expected)


async def test_requests_are_served_while_the_indexer_is_down(conductor):
    async with fleet(conductor.url, dispatch_policy="cache_aware", kvs_retry_times=0) as (gateway, _, _service):
        client = openai_client(gateway.url)
        messages = conversation("tides", "When is high water?")
        conductor.fail_with = (503, b'{"error": "restarting"}')
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert answer.choices[0].message.content
        plan = await schedule(gateway, {"model": MODEL, "messages": messages, "max_tokens": 4})
        assert plan["kvs_status"] == "down" and plan["selected"] in ("e0", "e1")
        await client.close()
        await assert_nothing_in_flight(gateway)

    async with fleet(closed_port_url(), dispatch_policy="cache_aware") as (gateway, _, _service):
        client = openai_client(gateway.url)
        answer = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4)
        assert answer.choices[0].message.content
        plan = await schedule(gateway, {"model": MODEL, "messages": messages, "max_tokens": 4})
        assert plan["kvs_status"] in ("error", "down")
        await client.close()
        await assert_nothing_in_flight(gateway)


async def test_doctor_asks_the_indexer_by_token_ids(conductor):
    engine = await start_mock_engine(MockEngineConfig(time_scale=0.0, settings=Settings(kvs_chunk_size=CHUNK),
                                                      profile=ServiceProfile().with_block_size(CHUNK)),
                                     tokenizer=TokenizerService(tokenizer()))
    settings = Settings(kvs_backend=KVSBackendName.CONDUCTOR, kvs_conductor_url=conductor.url, kvs_chunk_size=CHUNK,
                        kvs_query_budget_ms=2000, instances=[InstanceConfig(id="e0", url=engine.url, model=MODEL)])
    try:
        results = {(r.check, r.subject): r for r in await diagnose(settings, TokenizerService(tokenizer()),
                                                                    timeout_s=10, store_wait_s=0.3)}
    finally:
        await engine.close()
    assert results[("conductor store reachable", "store")].passed
    assert len(conductor.requests[0]["token_ids"]) == CHUNK and conductor.requests[0]["model"] == MODEL
    # The mock engine sends the indexer no KV events: its probe blocks are missing, and the fix says
    # how an engine gets into the indexer (no hashing variant can explain a miss there).
    blocks = results[("block keys in store", "e0")]
    assert not blocks.passed and "POST /register" in blocks.fix
    assert all(len(body["token_ids"]) % CHUNK == 0 for body in conductor.requests)
