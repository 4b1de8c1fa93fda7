"""Routing on the engines' KV events end to end: engines publish over real ZMQ sockets, the gateway
indexes their blocks, /debug/schedule shows where each hit came from and cache_aware follows them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

import aiohttp
import pytest

from kvgate.config.settings import InstanceConfig, KVSBackendName
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.kvs_client import EmbeddedKVSIndex
from kvgate.scheduler.hashing import BlockExtras
from kvgate.scheduler.router import Scheduler
from tests.gateway_helpers import assert_nothing_in_flight, gateway_settings, tokenizer
from tests.kv_events_engine import FakeEventsEngine, removed
from tests.scripted_upstream import MODEL, ScriptedUpstream

pytestmark = pytest.mark.timeout(90)

BLOCK = 16
PROMPT = list(range(2000, 2000 + 5 * BLOCK + 3))  # five full blocks and a tail
SAME_PREFIX = PROMPT[: 5 * BLOCK] + [7, 8, 9, 10]


async def schedule(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(url + "/debug/schedule", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def plan_once(url: str, body: dict, ready: Callable[[dict[str, dict]], bool]) -> dict:
    """/debug/schedule's answer once `ready(instances by id)` holds (events arrive asynchronously)."""
    deadline = time.monotonic() + 10
    while True:
        plan = await schedule(url, body)
        if ready(by_id(plan)):
            return plan
        assert time.monotonic() < deadline, plan
        await asyncio.sleep(0.02)


async def complete(url: str, prompt: list[int]) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        await response.read()


@pytest.fixture
async def fleet() -> AsyncIterator[tuple[list[ScriptedUpstream], list[FakeEventsEngine]]]:
    upstreams = [await ScriptedUpstream(f"e{i}").start() for i in range(2)]
    engines = [await FakeEventsEngine(block_size=BLOCK).start() for _ in range(2)]
    yield upstreams, engines
    for engine in engines:
        await engine.close()
    for upstream in upstreams:
        await upstream.close()


def instances(upstreams, engines, **extra) -> list[InstanceConfig]:
    return [InstanceConfig(id=u.name, url=u.url, model=MODEL, kv_events_endpoint=e.endpoint,
                           kv_events_replay_endpoint=e.replay_endpoint, **extra.get(u.name, {}))
            for u, e in zip(upstreams, engines, strict=True)]


def by_id(plan: dict) -> dict[str, dict]:
    return {entry["id"]: entry for entry in plan["instances"]}


async def test_cache_aware_follows_the_blocks_an_engine_published(fleet):
    upstreams, engines = fleet
    settings = gateway_settings({}, MODEL, kvs_backend=KVSBackendName.KV_EVENTS, kvs_chunk_size=BLOCK,
                                dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=BLOCK,
                                kv_events_topic="kv-events", instances=instances(upstreams, engines))
    gateway = await start_gateway(settings, tokenizer=tokenizer())
    try:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        before = by_id(await schedule(gateway.url, body))
        assert before["e1"]["events"]["state"] == "silent"  # nothing heard yet: unknown, not empty
        for engine in engines:
            await engine.wait_subscribed()
        await engines[0].publish([engines[0].store_prompt(PROMPT[:BLOCK])])  # e0 holds only block 0
        await engines[1].publish([engines[1].store_prompt(PROMPT)])

        # Each engine's events arrive on a socket of its own, in no order between them: wait for both.
        plan = await plan_once(gateway.url, body, lambda scores: scores["e1"]["prefix_hit_tokens"] == 5 * BLOCK
                               and scores["e0"]["prefix_hit_tokens"] == BLOCK)
        scores = by_id(plan)
        assert plan["selected"] == "e1"
        assert plan["kvs_status"] == "skipped" and plan["events_status"] == "ok"
        assert scores["e1"]["hit_source"] == "events" and scores["e1"]["store_hit_tokens"] is None
        assert scores["e1"]["events"] == {"state": "synced", "tokens": 5 * BLOCK, "gpu_tokens": 5 * BLOCK,
                                          "cpu_tokens": 0, "disk_tokens": 0}
        assert scores["e0"]["prefix_hit_tokens"] == BLOCK
        assert scores["e0"]["prefix_miss_tokens"] == len(PROMPT) - BLOCK

        for prompt in (PROMPT, SAME_PREFIX):
            await complete(gateway.url, prompt)
        assert (len(upstreams[0].seen), len(upstreams[1].seen)) == (0, 2)

        # The engine evicts the blocks: the next request is routed on load again.
        await engines[1].publish([removed(engines[1].hashes(PROMPT))])
        plan = await plan_once(gateway.url, body, lambda scores: scores["e1"]["prefix_hit_tokens"] == 0)
        assert by_id(plan)["e1"]["hit_source"] is None
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()


async def test_events_beside_a_store_each_hit_says_where_it_came_from(fleet):
    upstreams, engines = fleet
    configs = instances(upstreams, engines, e0={"kvs_endpoints": ("127.0.0.2",)})
    # e0 publishes no events (only the store knows its blocks); e1 publishes events.
    configs[0] = configs[0].model_copy(update={"kv_events_endpoint": "", "kv_events_replay_endpoint": ""})
    settings = gateway_settings({}, MODEL, kvs_backend=KVSBackendName.EMBEDDED, kvs_chunk_size=BLOCK,
                                dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=BLOCK,
                                kv_events_topic="kv-events", instances=configs)
    store = EmbeddedKVSIndex()
    scheduler = Scheduler(settings, settings.instances)
    store.add(scheduler.block_keys(scheduler.block_hashes(PROMPT))[:2], "127.0.0.2:17000")
    gateway = await start_gateway(settings, kvs_index=store, tokenizer=tokenizer())
    try:
        await engines[1].wait_subscribed()
        await engines[1].publish([engines[1].store_prompt(PROMPT[: 2 * BLOCK]),
                                  engines[1].store_prompt(PROMPT[: 4 * BLOCK], medium="CPU", skip=2)])
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
        plan = await plan_once(gateway.url, body, lambda scores: scores["e1"]["prefix_hit_tokens"] == 4 * BLOCK)
        scores = by_id(plan)
        assert plan["kvs_status"] == "ok" and plan["events_status"] == "ok"
        assert scores["e0"]["hit_source"] == "store" and scores["e0"]["store_hit_tokens"] == 2 * BLOCK
        assert scores["e0"]["events"]["state"] == "not_followed"
        assert scores["e1"]["hit_source"] == "events" and scores["e1"]["store_hit_tokens"] == 0
        assert scores["e1"]["events"]["gpu_tokens"] == 2 * BLOCK
        assert scores["e1"]["events"]["cpu_tokens"] == 2 * BLOCK
        # The CPU tier's blocks are loaded over the host link, at a price the TTFT model shows.
        assert scores["e1"]["transfer_tokens"] == 2 * BLOCK
        assert plan["selected"] == "e1"

        # A salted prompt's blocks hash otherwise, in the engine as in kvgate: not a hit until the
        # engine stores it salted, then a hit for that salt only.
        salted_body = {**body, "cache_salt": "tenant-a"}
        salted = await schedule(gateway.url, salted_body)
        assert salted["events_status"] == "ok"
        assert by_id(salted)["e1"]["prefix_hit_tokens"] == 0
        await engines[1].publish([engines[1].store_prompt(PROMPT[: 3 * BLOCK], extras=BlockExtras(cache_salt="tenant-a"))])
        salted = await plan_once(gateway.url, salted_body, lambda scores: scores["e1"]["prefix_hit_tokens"] == 3 * BLOCK)
        assert by_id(await schedule(gateway.url, {**body, "cache_salt": "tenant-b"}))["e1"]["prefix_hit_tokens"] == 0
        async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as response:
            text = await response.text()
        assert not [line for line in text.splitlines() if line.startswith("kvgate_kv_events_unmatched_requests")]
        assert 'kvgate_kv_events_blocks{instance="e1",medium="CPU"} 2.0' in text
        assert "kvgate_kv_events_subscriptions 1.0" in text
    finally:
        await gateway.close()


async def test_a_long_text_prompt_is_tokenized_as_far_as_an_engine_holds_it(fleet):
    """--tokenize-tail estimate tokenizes a first window only; while the events show an engine holding
    its last block, the window grows, so the whole held prefix counts."""
    upstreams, engines = fleet
    settings = gateway_settings({}, MODEL, kvs_backend=KVSBackendName.KV_EVENTS, kvs_chunk_size=BLOCK,
                                dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=BLOCK,
                                tokenize_tail="estimate", instances=instances(upstreams, engines))
    # One line per rule: the tokenizer caches and encodes text by lines (whole segments).
    rules = "\n".join(f"Rule {i}: answer briefly and exactly, quoting the manual's section {i} verbatim."
                      for i in range(40))
    messages = [{"role": "system", "content": rules},
                {"role": "user", "content": "Which rule matters most?"}]
    service = TokenizerService(tokenizer())
    ids = service.encode_chat_sync(messages)
    service.close()
    held = len(ids) // BLOCK - 2  # the system prompt's blocks, clear of the question
    assert held > 8  # far past the first window (two blocks of new text)
    gateway = await start_gateway(settings, tokenizer=tokenizer())
    try:
        await engines[1].wait_subscribed()
        await engines[1].publish([engines[1].store_prompt(ids[: held * BLOCK])])
        body = {"model": MODEL, "messages": messages, "max_tokens": 2}
        plan = await plan_once(gateway.url, body, lambda scores: scores["e1"]["prefix_hit_tokens"] > 0)
        assert by_id(plan)["e1"]["prefix_hit_tokens"] == held * BLOCK
        assert plan["selected"] == "e1"
        async with aiohttp.ClientSession() as session, session.get(gateway.url + "/metrics") as response:
            text = await response.text()
        assert "kvgate_tokenize_extensions_total 0.0" not in text
    finally:
        await gateway.close()


async def test_a_lora_adapters_requests_go_to_its_engines_and_hit_its_blocks(fleet):
    """e1 serves the adapter "sql": a request naming it goes to e1 only, its keys mix in the adapter
    as vLLM's do, and the base model's blocks are no hit for it (nor its blocks for the base)."""
    upstreams, engines = fleet
    settings = gateway_settings({}, MODEL, kvs_backend=KVSBackendName.KV_EVENTS, kvs_chunk_size=BLOCK,
                                dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=BLOCK,
                                kv_events_topic="kv-events",
                                instances=instances(upstreams, engines, e1={"lora_adapters": {"sql": "/lora/sql"}}))
    sql = BlockExtras(lora=("sql", "/lora/sql"))
    gateway = await start_gateway(settings, tokenizer=tokenizer())
    try:
        for engine in engines:
            await engine.wait_subscribed()
        await engines[0].publish([engines[0].store_prompt(PROMPT)])  # the base model's blocks
        await engines[1].publish([engines[1].store_prompt(SAME_PREFIX[: 3 * BLOCK], extras=sql)])
        adapter_body = {"model": "sql", "prompt": PROMPT, "max_tokens": 2}
        plan = await plan_once(gateway.url, adapter_body, lambda scores: scores["e1"]["prefix_hit_tokens"] == 3 * BLOCK)
        assert [entry["id"] for entry in plan["instances"]] == ["e1"] and plan["selected"] == "e1"
        base = await plan_once(gateway.url, {**adapter_body, "model": MODEL},
                               lambda scores: scores["e0"]["prefix_hit_tokens"] == len(PROMPT) // BLOCK * BLOCK)
        assert by_id(base)["e1"]["prefix_hit_tokens"] == 0

        async with aiohttp.ClientSession() as session:
            async with session.post(gateway.url + "/v1/completions", json=adapter_body) as response:
                assert response.status == 200, await response.text()
            async with session.get(gateway.url + "/v1/models") as response:
                assert {model["id"] for model in (await response.json())["data"]} == {MODEL, "sql"}
        assert upstreams[1].seen[-1].body["model"] == "sql" and not upstreams[0].seen
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()


def test_one_adapter_name_has_one_path_across_the_fleet():
    configs = [InstanceConfig(id=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", model=MODEL,
                              lora_adapters={"sql": f"/lora/sql-v{i}"}) for i in range(2)]
    with pytest.raises(ValueError, match="loaded from '/lora/sql-v0' and from '/lora/sql-v1'"):
        gateway_settings({}, MODEL, instances=configs)
    with pytest.raises(ValueError, match="also a base model"):
        gateway_settings({}, MODEL, instances=[configs[0].model_copy(update={"lora_adapters": {MODEL: "/x"}})])
