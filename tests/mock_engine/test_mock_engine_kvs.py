"""The mock engine publishes the blocks it caches, and withdraws evicted ones, to real stores.

Keys are recomputed here with the gateway's own hashing and key format, so a pass means the
gateway would find exactly these blocks.
"""

from __future__ import annotations

import random

import aiohttp
import pytest

from kvgate.config.settings import Settings
from kvgate.engine_model import ServiceProfile
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.kvs_client.redis_index import RedisIndexBackend
from kvgate.mock_engine.publishers import PublisherOptions, open_publisher
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.key_formats import make_key_format

BLOCK = 256
# 24 blocks: two 16-block prompts cannot both stay cached, so the second evicts the first.
SMALL_PROFILE = ServiceProfile(cache_capacity_blocks=24)


def _prompt(blocks: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 32000) for _ in range(blocks * BLOCK + 10)]


def _gateway_keys(settings: Settings, token_ids: list[int]) -> list[str]:
    blocks = hash_blocks(settings.kvs_hash_algo, token_ids, settings.kvs_chunk_size, seed=settings.hash_seed)
    return make_key_format(settings).keys(blocks)


async def _complete(url: str, prompt: list[int]) -> None:
    body = {"model": "kvgate/mock-llm", "prompt": prompt, "max_tokens": 1}
    async with (
        aiohttp.ClientSession() as session,
        session.post(url + "/v1/completions", json=body) as response,
    ):
        assert response.status == 200, await response.text()


async def _engine(settings: Settings, options: PublisherOptions, embedded_index=None):
    publisher = await open_publisher(options, embedded_index)
    return await start_mock_engine(
        MockEngineConfig(time_scale=0.0, profile=SMALL_PROFILE, settings=settings), publisher=publisher
    )


async def _master_endpoints(admin_url: str, keys: list[str]) -> dict[str, list[str]]:
    """key -> transport endpoints the real master reports (empty when not found)."""
    url = admin_url + "/batch_query_keys"
    async with (
        aiohttp.ClientSession() as session,
        session.get(url, params={"keys": ",".join(keys)}) as response,
    ):
        assert response.status == 200
        data = (await response.json(content_type=None))["data"]
    return {key: [v["transport_endpoint_"] for v in (data[key]["values"] or [])] for key in keys}


@pytest.mark.mooncake
async def test_blocks_appear_at_the_engines_ip_in_the_mooncake_master(mooncake_master):
    settings = Settings(kvs_backend="mooncake")
    options = PublisherOptions(
        "mooncake",
        settings,
        local_ip="127.0.0.2",
        mooncake_master=mooncake_master.rpc_address,
        mooncake_metadata_url=mooncake_master.metadata_url,
    )
    engine = await _engine(settings, options)
    first, second = _prompt(16, seed=1), _prompt(16, seed=2)
    first_keys, second_keys = _gateway_keys(settings, first), _gateway_keys(settings, second)
    try:
        await _complete(engine.url, first)
        await engine.engine.publication.flushed()
        held = await _master_endpoints(mooncake_master.admin_url, first_keys)
        assert all(
            len(endpoints) == 1 and endpoints[0].startswith("127.0.0.2:") for endpoints in held.values()
        )

        await _complete(engine.url, second)
        await engine.engine.publication.flushed()
        held = await _master_endpoints(mooncake_master.admin_url, first_keys + second_keys)
        assert all(held[key] for key in second_keys)
        # Least recently used first: the first prompt's leading blocks made room.
        evicted = [key for key in first_keys if not held[key]]
        assert evicted and evicted == first_keys[: len(evicted)]
    finally:
        await engine.close()
    # A closed store client takes its objects with it.
    assert not any((await _master_endpoints(mooncake_master.admin_url, second_keys)).values())


@pytest.mark.redis
async def test_blocks_are_claimed_and_withdrawn_in_redis(redis_url):
    settings = Settings(kvs_backend="redis", kvs_redis_url=redis_url)
    engine = await _engine(settings, PublisherOptions("redis", settings, local_ip="127.0.0.3"))
    reader = RedisIndexBackend(redis_url, settings.kvs_redis_key_prefix, request_timeout_s=2)
    first, second = _prompt(16, seed=3), _prompt(16, seed=4)
    first_keys, second_keys = _gateway_keys(settings, first), _gateway_keys(settings, second)
    try:
        await _complete(engine.url, first)
        await engine.engine.publication.flushed()
        answer = await reader.query(first_keys)
        assert [answer.locations.get(key) for key in first_keys] == [("127.0.0.3",)] * 16

        await _complete(engine.url, second)
        await engine.engine.publication.flushed()
        answer = await reader.query(first_keys + second_keys)
        assert all(key in answer.locations for key in second_keys)
        assert any(key not in answer.locations for key in first_keys)
        await engine.close()
        # A clean shutdown withdraws every claim.
        assert (await reader.query(first_keys + second_keys)).locations == {}
    finally:
        await engine.close()
        await reader.close()


async def test_embedded_index_follows_the_cache():
    settings = Settings(kvs_backend="embedded")
    index = EmbeddedKVSIndex()
    engine = await _engine(settings, PublisherOptions("embedded", settings, local_ip="127.0.0.4"), index)
    prompt = _prompt(16, seed=5)
    try:
        await _complete(engine.url, prompt)
        await engine.engine.publication.flushed()
        assert [index.holders(key) for key in _gateway_keys(settings, prompt)] == [("127.0.0.4",)] * 16
        assert len(index) == engine.engine.core.stats().num_cached_blocks
    finally:
        await engine.close()
    assert len(index) == 0


async def _cached_tokens(url: str, prompt: list[int]) -> int:
    body = {"model": "kvgate/mock-llm", "prompt": prompt, "max_tokens": 1}
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return (await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"]


async def test_a_store_segment_larger_than_the_cache_keeps_evicted_blocks_and_loads_them_back(tmp_path):
    """HBM holds 24 blocks, the segment 64: the store index lists both prompts while the engine's
    KV events say the first left HBM; a repeat of the first is loaded back, and its events say so."""
    import zmq.asyncio

    from kvgate.kvs_client.events.keys import engine_block_hashes
    from kvgate.mock_engine.kv_events import KVEventsOptions
    from tests.kv_events_client import replay

    settings = Settings(kvs_backend="embedded")
    index = EmbeddedKVSIndex()
    events = KVEventsOptions(f"ipc://{tmp_path}/e.events", f"ipc://{tmp_path}/e.replay")
    config = MockEngineConfig(time_scale=0.0, profile=SMALL_PROFILE, settings=settings, kv_events=events,
                              store_segment_blocks=64)
    publisher = await open_publisher(PublisherOptions("embedded", settings, local_ip="127.0.0.4"), index)
    engine = await start_mock_engine(config, publisher=publisher)
    first, second = _prompt(16, seed=1), _prompt(16, seed=2)
    ctx = zmq.asyncio.Context()
    try:
        assert await _cached_tokens(engine.url, first) == 0
        assert await _cached_tokens(engine.url, second) == 0
        await engine.engine.publication.flushed()
        keys = _gateway_keys(settings, first) + _gateway_keys(settings, second)
        assert [index.holders(key) for key in keys] == [("127.0.0.4",)] * 32  # HBM could not hold both
        assert engine.engine.core.stats().num_cached_blocks <= 24
        assert await _cached_tokens(engine.url, first) == 16 * BLOCK  # loaded from the segment
        batches, _ = await replay(ctx, events.replay_endpoint, 0)
    finally:
        ctx.term()
        await engine.close()
    hashes = engine_block_hashes(first, block_size=BLOCK, seed=settings.hash_seed)
    stored = [h for b in batches for e in b.events() if e["type"] == "BlockStored" for h in e["block_hashes"]]
    removed = {h for b in batches for e in b.events() if e["type"] == "BlockRemoved" for h in e["block_hashes"]}
    assert hashes[0] in removed  # the events told the first prompt left HBM...
    assert all(stored.count(h) == 2 for h in hashes if h in removed)  # ...and came back, loaded


def test_mock_engine_refuses_a_negative_store_segment():
    with pytest.raises(ValueError, match="store_segment_blocks"):
        MockEngineConfig(store_segment_blocks=-1)
