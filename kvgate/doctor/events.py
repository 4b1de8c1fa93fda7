"""The KV-events check of `kvgate doctor`: the probe's blocks as the engine itself announces them.

For an instance with a `kv_events_endpoint`, a SUB socket listens before the probe completion is
sent; the BlockStored events that follow must carry the gateway's keys for the probe's full blocks
(scheduler/hashing.py's sha256_cbor digests, compared as the events index compares them). When they
do not, the events name the cause: their `block_size` is the engine's, and the probe hashed with
another seed ("0", or vLLM's own "vllm-none-hash" when PYTHONHASHSEED is unset) gives the engine's seed.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

import zmq
import zmq.asyncio

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.doctor.results import CheckResult
from kvgate.kvs_client.events import DECODERS
from kvgate.kvs_client.events.base import BlocksStored, MalformedEvents
from kvgate.kvs_client.events.keys import engine_block_hashes, key_of

NAME = "block keys in KV events"
# A SUB socket misses what is published before its connection is up.
_CONNECT_S = 0.3
# Seeds an engine is likely to run with: kvgate's default, and vLLM's when PYTHONHASHSEED is unset.
_LIKELY_SEEDS = ("0", "vllm-none-hash")


@contextlib.asynccontextmanager
async def listening(settings: Settings, instance: InstanceConfig) -> AsyncIterator[EventsListener]:
    listener = EventsListener(settings, instance)
    try:
        await asyncio.sleep(_CONNECT_S)
        yield listener
    finally:
        listener.close()


class EventsListener:
    def __init__(self, settings: Settings, instance: InstanceConfig) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(instance.kv_events_endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, settings.kv_events_topic.encode())
        self._decoder = DECODERS[settings.kv_events_format]()

    async def stored(self, blocks: int, wait_s: float) -> list[BlocksStored]:
        """BlockStored events until `blocks` hashes arrived or `wait_s` passed."""
        events: list[BlocksStored] = []
        deadline = time.monotonic() + wait_s
        while sum(len(e.hashes) for e in events) < blocks and (left := deadline - time.monotonic()) > 0:
            try:
                frames = await asyncio.wait_for(self._socket.recv_multipart(), left)
                batch = self._decoder.decode(frames[-1])
            except (TimeoutError, MalformedEvents):
                continue
            events.extend(e for e in batch.events if isinstance(e, BlocksStored))
        return events

    def close(self) -> None:
        self._socket.close()


def check_events(settings: Settings, instance: InstanceConfig, prompt: Sequence[int],
                 events: Sequence[BlocksStored], wait_s: float) -> CheckResult:
    chunk = settings.kvs_chunk_size
    expected = [key_of(h) for h in engine_block_hashes(prompt, chunk, settings.hash_seed)]
    announced = [key_of(h) for event in events for h in event.hashes]
    if not announced:
        return CheckResult(NAME, instance.id, False,
                           f"no BlockStored event from {instance.kv_events_endpoint} within {wait_s:g} s of the probe",
                           "start the engine with --kv-events-config (enable_kv_cache_events, publisher zmq, "
                           "endpoint tcp://*:PORT) and set kv_events_endpoint to that port on this host")
    if announced[: len(expected)] == expected:
        return CheckResult(NAME, instance.id, True, f"the engine announced all {len(expected)} probe blocks "
                           "under the gateway's keys")
    sizes = sorted({event.block_size for event in events})
    if sizes != [chunk]:
        return CheckResult(NAME, instance.id, False,
                           f"the engine's blocks are {', '.join(map(str, sizes))} tokens, the gateway's "
                           f"kvs_chunk_size is {chunk}",
                           f"set kvs_chunk_size to the engine's --block-size ({sizes[0]})")
    for seed in _LIKELY_SEEDS:
        keys = [key_of(h) for h in engine_block_hashes(prompt, chunk, seed)]
        if seed != settings.hash_seed and announced[: len(keys)] == keys:
            return CheckResult(NAME, instance.id, False,
                               f"the engine hashes with seed {seed!r}, the gateway with hash_seed "
                               f"{settings.hash_seed!r}",
                               "make hash_seed (GO_HASH_SEED) and the engine's PYTHONHASHSEED the same string")
    return CheckResult(NAME, instance.id, False,
                       "the engine's block hashes match no seed kvgate tried: it hashes with another algorithm "
                       "or seed",
                       "start the engine with --prefix-caching-hash-algo sha256_cbor and PYTHONHASHSEED equal "
                       "to hash_seed")
