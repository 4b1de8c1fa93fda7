"""The demo's fleet with KV events on: every engine publishes on its own sockets, and a decode
engine of a disaggregated fleet reports the KV it pulled, as vLLM reports blocks a connector loads."""

from __future__ import annotations

import aiohttp
import zmq.asyncio

from kvgate.config.settings import HashAlgo, PDProtocol, Settings
from kvgate.demo.fleet import FleetSpec, KVEventsSpec, running_fleet
from kvgate.mock_engine.server import MockEngineConfig
from kvgate.scheduler.hashing import hash_blocks
from tests.gateway_helpers import tokenizer
from tests.kv_events_client import replay

MODEL = MockEngineConfig().model


async def test_prefill_and_decode_engines_both_publish_the_prompt_s_blocks(tmp_path):
    events = KVEventsSpec(str(tmp_path), hash_format="bytes")
    spec = FleetSpec(2, MockEngineConfig(time_scale=0.02), pd_protocol=PDProtocol.VLLM, kv_events=events)
    prompt = list(range(1000, 1000 + 3 * 256 + 40))
    async with running_fleet(spec, "cache_aware", tokenizer()) as url:
        async with aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
        ctx = zmq.asyncio.Context()
        try:
            published = [await replay(ctx, events.replay_endpoint(i), 0) for i in range(2)]
        finally:
            ctx.term()
    settings = Settings()
    expected = [bytes.fromhex(b.value)
                for b in hash_blocks(HashAlgo.SHA256_CBOR, prompt, settings.kvs_chunk_size, seed=settings.hash_seed)]
    assert len(expected) == 3
    for index, (batches, _) in enumerate(published):  # engine 0 prefills, engine 1 decodes
        stored = [e for b in batches for e in b.events() if e["type"] == "BlockStored"]
        assert [h for e in stored for h in e["block_hashes"]] == expected, f"engine-{index}"
        assert stored[0]["parent_block_hash"] is None


def test_without_a_directory_engines_bind_tcp_ports_subscribers_reach_on_loopback():
    events = KVEventsSpec()
    bound = events.options(1)
    port = int(events.endpoint(1).rsplit(":", 1)[1])
    assert (bound.endpoint, bound.replay_endpoint) == (f"tcp://*:{port}", events.replay_endpoint(1).replace(
        "127.0.0.1", "*"))
    assert events.endpoint(1) == f"tcp://127.0.0.1:{port}" == events.endpoint(1)  # picked once
    assert events.endpoint(0) != events.endpoint(1) != events.replay_endpoint(1)
