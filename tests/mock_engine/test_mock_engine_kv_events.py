"""A mock engine's KV events over real ZMQ sockets on loopback: what vLLM 0.32 would publish for the
same prompts (hashes, parent chain, evictions, resets, sequence numbers, replay, restart)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from kvgate.cli import main
from kvgate.config.settings import HashAlgo, Settings
from kvgate.engine_model import EngineCore, EngineRequest, ServiceProfile
from kvgate.mock_engine.block_keys import BlockKeyer
from kvgate.mock_engine.kv_events import KVEventsOptions
from kvgate.mock_engine.server import MockEngineConfig, MockEngineHandle, start_mock_engine
from kvgate.processes import free_port
from kvgate.scheduler.hashing import hash_blocks
from tests.kv_events_client import Subscriber, complete, replay

BLOCK = 16
SEED = "kv-events-seed"


def _config(events: KVEventsOptions, capacity_blocks: int = 256, algo: str = "sha256_cbor") -> MockEngineConfig:
    profile = dataclasses.replace(ServiceProfile().with_block_size(BLOCK), cache_capacity_blocks=capacity_blocks)
    settings = Settings(kvs_chunk_size=BLOCK, hash_seed=SEED, kvs_hash_algo=algo)
    return MockEngineConfig(profile=profile, settings=settings, time_scale=0.0, kv_events=events)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 32000) for _ in range(length)]


def _vllm_hashes(prompt: list[int], hash_format: str) -> list[int | bytes]:
    """vLLM's block hashes computed here from REFERENCE.md section 1, then as events carry them."""
    digests = [bytes.fromhex(b.value) for b in hash_blocks(HashAlgo.SHA256_CBOR, prompt, BLOCK, seed=SEED)]
    if hash_format == "bytes":
        return digests
    return [int.from_bytes(d, "big") & (2**64 - 1) for d in digests]


@pytest.fixture
async def zmq_ctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.term()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


@pytest.fixture
async def engines() -> AsyncIterator[list[MockEngineHandle]]:
    started: list[MockEngineHandle] = []
    yield started
    for handle in started:
        await handle.close()


async def _start(engines: list[MockEngineHandle], config: MockEngineConfig) -> MockEngineHandle:
    handle = await start_mock_engine(config)
    engines.append(handle)
    return handle


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("hash_format", ["int", "bytes"])
async def test_events_name_blocks_by_vllm_hashes_and_chain_them(zmq_ctx, session, engines, encoding, hash_format):
    # An explicit address: the engine connects, the subscriber binds (vLLM's rule).
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(zmq_ctx, endpoint, bind=True)
    try:
        # The store keys use another algorithm: events still carry vLLM's own hashes.
        engine = await _start(engines, _config(KVEventsOptions(endpoint, encoding=encoding, hash_format=hash_format),
                                               algo="xxhash"))
        await sub.until_live(engine, session)

        prompt = _prompt(3 * BLOCK + 5, seed=1)
        await complete(session, engine.url, prompt)
        [batch] = await sub.drain()
        assert batch.topic == b"kv-events"
        [stored] = batch.events()
        expected = _vllm_hashes(prompt, hash_format)
        assert stored == {
            "type": "BlockStored",
            "block_hashes": expected,  # full blocks only: the 5-token tail is never stored
            "parent_block_hash": None,
            "token_ids": prompt[: 3 * BLOCK],
            "block_size": BLOCK,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            # vLLM 0.32 leaves out fields at their default (None) in maps, never in arrays.
            **({} if encoding == "map" else {"extra_keys": None, "kv_cache_spec_sliding_window": None}),
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }

        # Two cached blocks, then new ones: stored with the second block as parent.
        longer = prompt[: 2 * BLOCK] + _prompt(2 * BLOCK, seed=2)
        await complete(session, engine.url, longer)
        [batch] = await sub.drain()
        [stored] = batch.events()
        longer_hashes = _vllm_hashes(longer, hash_format)
        assert longer_hashes[:2] == expected[:2]
        assert stored["block_hashes"] == longer_hashes[2:]
        assert stored["parent_block_hash"] == expected[1]
        assert stored["token_ids"] == longer[2 * BLOCK :]
    finally:
        sub.close()


async def test_hashes_match_the_reference_golden_vectors(zmq_ctx, session, engines):
    """REFERENCE.md section 1: sha256_cbor of range(32) in 16-token blocks, seed "0"."""
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    config = _config(KVEventsOptions(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay_endpoint,
                                     hash_format="bytes"))
    engine = await _start(engines, dataclasses.replace(config, settings=Settings(kvs_chunk_size=BLOCK, hash_seed="0")))
    await complete(session, engine.url, list(range(32)))
    [batch], _ = await replay(zmq_ctx, replay_endpoint, 0)
    [stored] = batch.events()
    assert [h.hex() for h in stored["block_hashes"]] == [
        "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
        "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
    ]


async def test_blocks_filled_by_generated_tokens_are_stored_as_the_chain_goes_on(zmq_ctx, session, engines):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = KVEventsOptions(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay_endpoint)
    engine = await _start(engines, _config(options))
    prompt = _prompt(2 * BLOCK + 5, seed=21)
    # The KV of 37 prompt + 31 generated tokens (never the last one's): 4 full blocks, 2 after the prompt.
    await complete(session, engine.url, prompt, max_tokens=2 * BLOCK)
    batches, _ = await replay(zmq_ctx, replay_endpoint, 0)
    stored = [event for batch in batches for event in batch.events()]
    assert all(event["type"] == "BlockStored" for event in stored)
    tokens = [token for event in stored for token in event["token_ids"]]
    assert len(tokens) == 4 * BLOCK and tokens[: len(prompt)] == prompt
    hashes = [h for event in stored for h in event["block_hashes"]]
    assert hashes == _vllm_hashes(tokens, "int")  # each block names its tokens, chained from the prompt's
    assert stored[0]["parent_block_hash"] is None
    for previous, event in zip(stored, stored[1:], strict=False):
        assert event["parent_block_hash"] == previous["block_hashes"][-1]
    # Generated blocks come one by one, as decode steps complete them.
    assert [len(event["block_hashes"]) for event in stored] == [2, 1, 1]
    assert len(engine.engine.core.cache) == 4


async def test_a_step_s_events_go_out_once_its_modelled_time_has_passed(zmq_ctx, session, engines):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(zmq_ctx, endpoint, bind=True)
    try:
        config = dataclasses.replace(_config(KVEventsOptions(endpoint)), time_scale=2.0)
        engine = await _start(engines, config)
        await sub.until_live(engine, session)
        prompt = _prompt(4000, seed=31)
        # The first step of this prompt, as the engine model prices it (virtual time, a fresh core).
        model = EngineCore(config.profile)
        model.submit(EngineRequest("x", tuple(map(str, range(len(prompt) // BLOCK))), len(prompt), 1), 0.0)
        first_step_s = model.step(0.0).duration_s * config.time_scale
        assert first_step_s > 0.1
        sent = time.monotonic()
        answer = asyncio.ensure_future(complete(session, engine.url, prompt))
        await sub.recv()
        assert time.monotonic() - sent >= first_step_s  # vLLM publishes a step's events after it ran
        await answer
    finally:
        sub.close()


async def test_evictions_are_block_removed_and_the_events_rebuild_the_cache(zmq_ctx, session, engines):
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    options = KVEventsOptions(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay_endpoint)
    engine = await _start(engines, _config(options, capacity_blocks=12))
    keyer = BlockKeyer(engine.engine.config.settings)
    hash_of_key: dict[str, int] = {}
    for seed in range(6):  # 4 blocks each: the 12-block cache must evict
        prompt = _prompt(4 * BLOCK, seed=10 + seed)
        keys, _ = keyer.keys_and_vllm_hashes(prompt)
        hash_of_key.update(zip(keys, _vllm_hashes(prompt, "int"), strict=True))
        await complete(session, engine.url, prompt)
    # Every batch since the start, from the replay buffer (nothing sent before a SUB joined is lost).
    batches, _ = await replay(zmq_ctx, replay_endpoint, 0)
    events = [event for batch in batches for event in batch.events()]
    removed = [event for event in events if event["type"] == "BlockRemoved"]
    assert removed, "a full cache evicted nothing"
    # As vLLM: one block per BlockRemoved, with its medium and group.
    assert all(len(event["block_hashes"]) == 1 and event["medium"] == "GPU" and event["group_idx"] == 0
               for event in removed)
    for batch in batches:  # evictions happen while admitting, before the step computes blocks
        kinds = [event["type"] for event in batch.events()]
        assert kinds == sorted(kinds, key=lambda kind: kind != "BlockRemoved")

    index: set[int] = set()
    for event in events:
        if event["type"] == "BlockStored":
            assert not index & set(event["block_hashes"]), "a block stored twice"
            index.update(event["block_hashes"])
        else:
            assert set(event["block_hashes"]) <= index, "a block removed that was never stored"
            index.difference_update(event["block_hashes"])
    cache = engine.engine.core.cache
    assert index == set(map(hash_of_key.__getitem__, cache.keys()))
    # Nothing is described beyond what the cache holds once no request runs.
    assert len(engine.engine._block_events) == len(cache)


async def test_sequence_is_contiguous_and_replay_resends_from_a_seq(zmq_ctx, session, engines):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(zmq_ctx, endpoint, bind=True)
    try:
        engine = await _start(engines, _config(KVEventsOptions(endpoint, replay_endpoint=replay_endpoint)))
        next_seq = await sub.until_live(engine, session)
        for seed in range(5):
            await complete(session, engine.url, _prompt(2 * BLOCK, seed=100 + seed))
        live = await sub.drain()
    finally:
        sub.close()
    assert [b.seq for b in live] == list(range(next_seq, next_seq + 5))

    again, end = await replay(zmq_ctx, engine.engine.kv_events.replay_endpoint, live[2].seq)
    assert [(b.topic, b.seq, b.payload) for b in again] == [(b.topic, b.seq, b.payload) for b in live[2:]]
    assert end == [b"", (-1).to_bytes(8, "big", signed=True), b""]
    everything, _ = await replay(zmq_ctx, replay_endpoint, 0)
    assert [b.seq for b in everything] == list(range(0, next_seq + 5))
    past_the_end, _ = await replay(zmq_ctx, replay_endpoint, next_seq + 5)
    assert past_the_end == []


async def test_a_restarted_engine_starts_its_sequence_at_zero(zmq_ctx, session, engines, tmp_path):
    # ipc endpoints bind (vLLM's rule), so the subscriber connects and follows the restart.
    options = KVEventsOptions(f"ipc://{tmp_path}/events", replay_endpoint=f"ipc://{tmp_path}/replay")
    first = await _start(engines, _config(options))
    sub = Subscriber(zmq_ctx, options.endpoint, bind=False)
    try:
        await sub.until_live(first, session)
        for seed in range(10):
            await complete(session, first.url, _prompt(BLOCK, seed=200 + seed))
        before = (await sub.drain())[-1].seq + 1
        await first.close()
        second = await _start(engines, _config(options))
        after = await sub.until_live(second, session)  # the SUB reconnects by itself
    finally:
        sub.close()
    assert before >= 10 and after < before  # a backward sequence: the engine restarted
    batches, _ = await replay(zmq_ctx, options.replay_endpoint, 0)
    assert batches[0].seq == 0 and [b.seq for b in batches] == list(range(after))


async def test_a_cache_reset_is_all_blocks_cleared(zmq_ctx, session, engines):
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = Subscriber(zmq_ctx, endpoint, bind=True)
    try:
        engine = await _start(engines, _config(KVEventsOptions(endpoint, encoding="array")))
        await sub.until_live(engine, session)
        prompt = _prompt(3 * BLOCK, seed=7)
        await complete(session, engine.url, prompt)
        await sub.drain()
        async with session.post(engine.url + "/reset_prefix_cache") as response:
            assert response.status == 200 and await response.json() == {"success": True}
        [batch] = await sub.drain()
        assert batch.events() == [{"type": "AllBlocksCleared"}]
        assert len(engine.engine.core.cache) == 0
        # The same prompt is computed again and stored again, from the chain's start.
        await complete(session, engine.url, prompt)
        [batch] = await sub.drain()
        [stored] = batch.events()
        assert stored["block_hashes"] == _vllm_hashes(prompt, "int") and stored["parent_block_hash"] is None
    finally:
        sub.close()


async def test_a_cache_reset_fails_while_a_request_holds_blocks(engines, session):
    engine = await _start(engines, dataclasses.replace(
        _config(KVEventsOptions(f"tcp://127.0.0.1:{free_port()}")), time_scale=1.0))
    body = {"model": "kvgate/mock-llm", "prompt": _prompt(2 * BLOCK, seed=3), "max_tokens": 400, "stream": True}
    async with session.post(engine.url + "/v1/completions", json=body) as streaming:
        await streaming.content.readline()  # the first token is out: the request runs
        async with session.post(engine.url + "/reset_prefix_cache") as response:
            assert await response.json() == {"success": False}
        streaming.close()
    await asyncio.sleep(0)


async def test_a_taken_replay_address_fails_the_start():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        options = KVEventsOptions(f"tcp://127.0.0.1:{free_port()}",
                                  replay_endpoint=f"tcp://127.0.0.1:{taken.getsockname()[1]}")
        with pytest.raises(zmq.ZMQError):
            await start_mock_engine(_config(options))


async def test_the_command_publishes_with_its_flags(zmq_ctx, session, tmp_path):
    replay_endpoint = f"ipc://{tmp_path}/replay"
    argv = [sys.executable, "-m", "kvgate.cli", "mock-engine", "--port", "0", "--time-scale", "0",
            "--kvs-chunk-size", str(BLOCK), "--hash-seed", SEED, "--kv-events-endpoint", f"ipc://{tmp_path}/events",
            "--kv-events-replay-endpoint", replay_endpoint, "--kv-events-topic", "engine-7",
            "--kv-events-encoding", "array", "--kv-events-hash", "bytes"]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        line = await asyncio.to_thread(process.stdout.readline)
        assert f"KV events on ipc://{tmp_path}/events" in line, process.stderr.read() if process.poll() else line
        url = line.split("serving on ")[1].split()[0]
        prompt = _prompt(2 * BLOCK, seed=9)
        await complete(session, url, prompt)
        [batch], _ = await replay(zmq_ctx, replay_endpoint, 0)
        assert batch.topic == b"engine-7" and isinstance(msgpack.unpackb(batch.payload)[1][0], list)
        assert batch.events()[0]["block_hashes"] == _vllm_hashes(prompt, "bytes")
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


@pytest.mark.parametrize("flags, message", [
    (["--kv-events-replay-endpoint", "tcp://*:5558"], "--kv-events-replay-endpoint needs --kv-events-endpoint"),
    (["--kv-events-endpoint", "udp://127.0.0.1:5557"], "must start with tcp://, ipc:// or inproc://"),
])
def test_bad_kv_events_flags_exit_2(capsys, flags, message):
    assert main(["mock-engine", "--port", "0", *flags, "--check"]) == 2
    assert message in capsys.readouterr().err
