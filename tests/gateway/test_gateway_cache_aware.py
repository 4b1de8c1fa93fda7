"""Cache-aware routing end to end: the real Mooncake master says which host holds a prompt's prefix
blocks, and the gateway sends the request to the instance on that host.

Two store clients on 127.0.0.2 and 127.0.0.3 put block keys (computed by the same Scheduler the
gateway uses) into the master; instance e0 owns endpoint 127.0.0.2, e1 owns 127.0.0.3.
"""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.engine_model import ServiceProfile
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from kvgate.scheduler.router import Scheduler
from tests.gateway_helpers import assert_nothing_in_flight, tokenizer
from tests.services import store_client

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

CHUNK = 16
MODEL = "kvgate/mock-llm"


def conversation(topic: str, question: str) -> list[dict]:
    """A long shared system prompt per topic, then a varying question."""
    system = f"You are an expert on {topic}. " + " ".join(f"Fact {i} about {topic}." for i in range(40))
    return [{"role": "system", "content": system}, {"role": "user", "content": question}]


async def post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def test_requests_go_where_the_store_holds_their_prefix(mooncake_master, tmp_path):
    host, port = mooncake_master.admin_url.removeprefix("http://").split(":")
    base = Settings(
        kvs_backend=KVSBackendName.MOONCAKE,
        kvs_metadata_service_http_server_host=host,
        kvs_metadata_service_http_server_port=int(port),
        kvs_query_budget_ms=2000,
        kvs_chunk_size=CHUNK,
        dispatch_policy="cache_aware",
        cache_aware_scheduling_min_tokens=CHUNK,
    )
    engine_config = MockEngineConfig(time_scale=0.01, settings=base,
                                     profile=ServiceProfile().with_block_size(CHUNK))
    engines = [await start_mock_engine(engine_config, tokenizer=TokenizerService(tokenizer())) for _ in range(2)]
    instances = (
        InstanceConfig(id="e0", url=engines[0].url, model=MODEL, kvs_endpoints=("127.0.0.2",)),
        InstanceConfig(id="e1", url=engines[1].url, model=MODEL, kvs_endpoints=("127.0.0.3",)),
    )
    settings = base.model_copy(update={"port": 0, "instances": instances, "health_check_interval_s": 60.0})
    scheduler = Scheduler(settings, instances)
    service = TokenizerService(tokenizer())
    gateway = await start_gateway(settings, tokenizer=tokenizer())
    try:
        with (store_client(mooncake_master, "127.0.0.2", tmp_path) as on_e0,
              store_client(mooncake_master, "127.0.0.3", tmp_path) as on_e1):
            # Each host holds the templated system prompt of one topic (whole blocks of it).
            held = {}
            for topic, holder in (("rivers", on_e1), ("volcanoes", on_e0)):
                ids = service.encode_chat_sync(conversation(topic, "warm-up"))
                keys = scheduler.block_keys(scheduler.block_hashes(ids))
                held[topic] = len(keys) - 2  # keep clear of the question's tokens
                await asyncio.to_thread(holder.publish, keys[: held[topic]])

            for topic, expected in (("rivers", "e1"), ("volcanoes", "e0")):
                body = {"model": MODEL, "messages": conversation(topic, "Which is the longest?"), "max_tokens": 4}
                plan = await post(gateway.url, "/debug/schedule", body)
                assert plan["kvs_status"] == "ok"
                assert plan["selected"] == expected
                scores = {entry["id"]: entry for entry in plan["instances"]}
                assert scores[expected]["prefix_hit_tokens"] == held[topic] * CHUNK
                other = "e0" if expected == "e1" else "e1"
                assert scores[other]["prefix_hit_tokens"] == 0
                assert scores[other]["prefix_miss_tokens"] == plan["num_prompt_tokens"]
                assert plan["block_keys"][: held[topic]] == scheduler.block_keys(
                    scheduler.block_hashes(service.encode_chat_sync(body["messages"])))[: held[topic]]

                before = [e.engine.core.stats().prefix_cache_queries for e in engines]
                await post(gateway.url, "/v1/chat/completions", body)
                after = [e.engine.core.stats().prefix_cache_queries for e in engines]
                served = [b != a for b, a in zip(before, after, strict=True)]
                assert served == [expected == "e0", expected == "e1"]
            await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()
        service.close()
        for engine in engines:
            await engine.close()
