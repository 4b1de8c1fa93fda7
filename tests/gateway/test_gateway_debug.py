"""/debug/schedule is a dry run that tells the truth; the KV store is advice, never a dependency."""

from __future__ import annotations

import aiohttp
import pytest

from kvgate.config.settings import KVSBackendName
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client import EmbeddedKVSIndex
from kvgate.processes import free_port
from kvgate.scheduler.router import Scheduler
from tests.gateway_helpers import assert_nothing_in_flight, gateway_settings, scripted_upstreams, tokenizer
from tests.scripted_upstream import MODEL

CHUNK = 8
LONG_PROMPT = "A fairly long prompt about rivers and mountains. " * 10


@pytest.fixture
async def upstreams():
    async with scripted_upstreams("a", "b") as started:
        yield list(started.values())


async def post(url: str, path: str, body: dict) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json()


def cache_aware(upstreams, **overrides):
    values = {"dispatch_policy": "cache_aware", "kvs_chunk_size": CHUNK,
              "cache_aware_scheduling_min_tokens": CHUNK}
    values.update(overrides)
    settings = gateway_settings({u.name: u.url for u in upstreams}, MODEL, **values)
    instances = tuple(i.model_copy(update={"kvs_endpoints": (f"127.0.0.{2 + n}",)})
                      for n, i in enumerate(settings.instances))
    return settings.model_copy(update={"instances": instances})


async def test_debug_schedule_is_a_dry_run_with_the_real_plan(upstreams):
    index = EmbeddedKVSIndex()
    settings = cache_aware(upstreams)
    handle = await start_gateway(settings, kvs_index=index, tokenizer=tokenizer())
    try:
        body = {"model": MODEL, "prompt": LONG_PROMPT}
        ids = tokenizer().encode(LONG_PROMPT)
        scheduler = Scheduler(settings, settings.instances)
        keys = scheduler.block_keys(scheduler.block_hashes(ids))
        index.add(keys[:3], "127.0.0.3:17000")  # b's host holds the first three blocks

        status, plan = await post(handle.url, "/debug/schedule", body)
        assert status == 200
        assert plan["selected"] == "b" and plan["ranking"] == ["b", "a"]
        assert plan["kvs_status"] == "ok" and plan["cache_aware"] is True
        assert plan["num_prompt_tokens"] == len(ids) and plan["block_keys"] == keys
        scores = {entry["id"]: entry for entry in plan["instances"]}
        assert scores["b"]["prefix_hit_tokens"] == 3 * CHUNK
        assert scores["b"]["prefix_miss_tokens"] == len(ids) - 3 * CHUNK
        assert scores["a"]["prefix_hit_tokens"] == 0 and scores["a"]["prefix_miss_tokens"] == len(ids)
        assert set(scores["b"]["metrics"]) >= {"num_requests", "all_prefills_tokens_num"}
        # Nothing was forwarded and nothing entered the account.
        assert all(not u.seen for u in upstreams)
        assert handle.app[GATEWAY].account.total_inflight() == 0

        # Chat bodies are planned as chats (template applied).
        status, plan = await post(handle.url, "/debug/schedule",
                                  {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})
        assert status == 200 and plan["num_prompt_tokens"] == len(
            handle.app[GATEWAY].tokenizer.encode_chat_sync([{"role": "user", "content": "hi"}]))

        status, error = await post(handle.url, "/debug/schedule", {"model": MODEL, "prompt": ""})
        assert status == 400 and error["error"]["param"] == "prompt"
    finally:
        await handle.close()


async def test_requests_still_route_when_the_kv_store_is_unreachable(upstreams):
    # A Mooncake master that is not there: every lookup fails, then the store is marked down.
    settings = cache_aware(upstreams, kvs_backend=KVSBackendName.MOONCAKE,
                           kvs_metadata_service_http_server_port=free_port(), kvs_retry_times=0,
                           kvs_query_budget_ms=200)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    try:
        body = {"model": MODEL, "prompt": LONG_PROMPT}
        _, first = await post(handle.url, "/debug/schedule", body)
        _, second = await post(handle.url, "/debug/schedule", body)
        assert first["kvs_status"] == "error" and second["kvs_status"] == "down"
        assert all(entry["prefix_hit_tokens"] == 0 for entry in second["instances"])
        for _ in range(3):
            status, answer = await post(handle.url, "/v1/completions", body)
            assert status == 200 and answer["choices"][0]["text"]
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_debug_schedule_names_the_request_id(upstreams):
    handle = await start_gateway(cache_aware(upstreams), kvs_index=EmbeddedKVSIndex(), tokenizer=tokenizer())
    try:
        body = {"model": MODEL, "prompt": LONG_PROMPT}
        async with aiohttp.ClientSession() as session:
            async with session.post(handle.url + "/debug/schedule", json=body,
                                    headers={"X-Request-Id": "trace-me-42"}) as response:
                assert (await response.json())["request_id"] == "trace-me-42"
                assert response.headers["X-Request-Id"] == "trace-me-42"
            async with session.post(handle.url + "/debug/schedule", json=body) as response:
                given = (await response.json())["request_id"]
                assert len(given) == 32 and response.headers["X-Request-Id"] == given
    finally:
        await handle.close()


@pytest.mark.parametrize("top_k", [1, 2])
async def test_debug_schedule_leaves_the_tie_break_where_it_was(upstreams, top_k):
    """Round robin ties everything: each real request moves the cursor on, a debug call must not."""
    settings = gateway_settings({u.name: u.url for u in upstreams}, MODEL, dispatch_policy="least_load",
                                dispatch_top_k=top_k)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    try:
        body = {"model": MODEL, "prompt": "hello"}
        shown = [(await post(handle.url, "/debug/schedule", body))[1]["selected"] for _ in range(4)]
        assert len(set(shown)) == 1  # looking four times shows the same choice four times
        async with aiohttp.ClientSession() as session, \
                session.post(handle.url + "/v1/completions", json=body) as response:
            assert response.status == 200
            answered = (await response.json())["id"]
        assert answered == f"cmpl-{shown[0]}"  # and the next real request goes where it was shown
    finally:
        await handle.close()
