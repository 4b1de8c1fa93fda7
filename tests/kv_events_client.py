"""A test-side consumer of vLLM KV events: a real ZMQ SUB and a replay DEALER, and a decoder written
from vLLM's classes' field order (independent of kvgate's encoder)."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from kvgate.mock_engine.server import MockEngineHandle

# vLLM's declared field order of each event (vllm/distributed/kv_events.py).
FIELDS = {
    "BlockStored": (
        "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name",
        "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": (),
}


@dataclass
class Batch:
    topic: bytes
    seq: int
    payload: bytes

    @property
    def body(self) -> list[Any]:
        return msgpack.unpackb(self.payload)

    def events(self) -> list[dict[str, Any]]:
        """Every event as a dict with its "type", whichever shape it was sent in."""
        ts, events, rank = self.body
        assert isinstance(ts, float) and rank == 0
        out = []
        for event in events:
            if isinstance(event, dict):
                out.append(event)
            else:
                name, *values = event
                assert len(values) == len(FIELDS[name]), event
                out.append({"type": name, **dict(zip(FIELDS[name], values, strict=True))})
        return out


def parse(frames: list[bytes]) -> Batch:
    topic, seq, payload = frames
    assert len(seq) == 8
    return Batch(topic, int.from_bytes(seq, "big", signed=True), payload)


class Subscriber:
    """A SUB socket that binds (engines connect to an explicit address) or connects (engines bind)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, bind: bool, topic: bytes = b"kv-events") -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        (self.sock.bind if bind else self.sock.connect)(endpoint)

    async def recv(self, timeout_s: float = 5.0) -> Batch:
        return parse(await asyncio.wait_for(self.sock.recv_multipart(), timeout_s))

    async def drain(self, quiet_s: float = 0.3) -> list[Batch]:
        batches = []
        while True:
            try:
                batches.append(await self.recv(quiet_s))
            except TimeoutError:
                return batches

    async def until_live(self, engine: MockEngineHandle, session: aiohttp.ClientSession) -> int:
        """Send one-block prompts until an event arrives (a SUB misses what is sent before its
        subscription reaches the publisher); everything is drained; returns the next seq to expect."""
        block = engine.engine.config.profile.block_size
        rng = random.Random(4242)
        for _ in range(50):
            await complete(session, engine.url, [rng.randrange(50_000, 60_000) for _ in range(block)])
            try:
                first = await self.recv(0.2)
            except TimeoutError:
                continue
            batches = [first, *await self.drain()]
            return batches[-1].seq + 1
        raise AssertionError("no KV event reached the subscriber")

    def close(self) -> None:
        self.sock.close(linger=0)


async def replay(ctx: zmq.asyncio.Context, endpoint: str, start_seq: int) -> tuple[list[Batch], list[bytes]]:
    """Ask the engine's replay ROUTER for every batch from start_seq: (batches, the end marker's frames)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    try:
        await dealer.send_multipart([b"", start_seq.to_bytes(8, "big")])
        batches = []
        while True:
            empty, *frames = await asyncio.wait_for(dealer.recv_multipart(), 5.0)
            assert empty == b""
            batch = parse(frames)
            if batch.seq == -1:
                return batches, frames
            batches.append(batch)
    finally:
        dealer.close(linger=0)


async def complete(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int = 1) -> dict:
    body = {"model": "kvgate/mock-llm", "prompt": prompt, "max_tokens": max_tokens}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()
