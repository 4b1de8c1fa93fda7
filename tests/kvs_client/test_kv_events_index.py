"""The events index in shared memory: one writer, readers in other processes, bounded memory."""

from __future__ import annotations

import asyncio
import multiprocessing
import random

import numpy as np
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from kvgate.config.settings import InstanceConfig
from kvgate.kvs_client.events.base import Medium
from kvgate.kvs_client.events.index import EventsIndex
from kvgate.kvs_client.events.keys import prompt_keys
from kvgate.kvs_client.events.subscriber import FeedLimits, InstanceFeed
from kvgate.kvs_client.events.view import EventsView
from kvgate.kvs_client.events.vllm import VllmDecoder
from kvgate.metrics.definitions import kv_events_metrics
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.tiers import EnginePrefix
from tests.kv_events_engine import batch_payload, cleared, removed, stored

BLOCK = 16
PROMPT = list(range(8 * BLOCK))


def write(index: EventsIndex, slot: int, medium: Medium, keys, cap: int = 10**9) -> int:
    index.begin()
    try:
        return index.store(slot, medium, keys, cap)
    finally:
        index.end()


def test_instances_past_the_first_bitmap_word_and_every_medium():
    index = EventsIndex.create(1 << 20, 100)
    try:
        slots = {}
        for number in range(72):
            slots[f"e{number}"] = index.take_slot(f"e{number}")
        blocks = hash_blocks("sha256_cbor", PROMPT, BLOCK)
        keys = [int(k) for k in prompt_keys(blocks)]
        write(index, slots["e70"], Medium.GPU, keys[:3])
        write(index, slots["e70"], Medium.DISK, keys[3:5])
        write(index, slots["e3"], Medium.CPU, keys[:8])
        write(index, slots["e5"], Medium.GPU, keys[1:8])  # no block 0: no prefix
        hits = EventsView(index).hits(blocks)
        assert hits is not None
        assert dict(hits.prefixes) == {"e70": EnginePrefix(3 * BLOCK, 0, 2 * BLOCK), "e3": EnginePrefix(0, 8 * BLOCK)}
        assert hits.unknown == frozenset(slots)  # nobody has said a word yet (feed state SILENT)
    finally:
        index.close()


def test_removals_leave_tombstones_that_compaction_reclaims_and_a_full_index_refuses():
    index = EventsIndex.create(1 << 20, 8)
    slot = index.take_slot("e0")
    room = int(index.capacity * 0.75)
    rng = random.Random(1)
    keys = list(dict.fromkeys(rng.getrandbits(64) or 1 for _ in range(room + 10)))
    assert write(index, slot, Medium.GPU, keys) == 10  # past 3/4 of the rows: refused
    assert index.blocks(slot) == (room, 0, 0)
    index.begin()
    index.remove(slot, Medium.GPU, keys[:100])
    index.end()
    assert index.occupied == room  # removed keys stay as tombstones...
    assert write(index, slot, Medium.GPU, keys[room:]) == 0  # ...until new blocks need the rows
    found = index.lookup(np.array(keys[100 : room + 10], dtype=np.uint64))
    assert found is not None and bool((found[:, 0] == 1).all())
    assert not index.lookup(np.array(keys[:100], dtype=np.uint64)).any()
    index.forget(slot)
    index.begin()
    index.compact()
    index.end()
    assert index.occupied == 0 and index.blocks(slot) == (0, 0, 0)
    index.close()


def test_the_index_fits_its_byte_bound():
    for bound in (1 << 20, 5 * (1 << 20) + 123, 64 << 20):
        index = EventsIndex.create(bound, 64)
        assert index.nbytes <= bound
        assert index.nbytes > bound // 2  # and uses most of it
        index.close()


def _read_in_another_process(path: str, keys: list[int], answer) -> None:
    index = EventsIndex.attach(path)
    found = index.lookup(np.array(keys, dtype=np.uint64))
    answer.put((index.instance_slots(), found[:, 0].tolist() if found is not None else None))
    index.close()


def test_a_reader_in_another_process_sees_the_writers_blocks(tmp_path):
    index = EventsIndex.create(1 << 20, 8, str(tmp_path / "events"))
    slot = index.take_slot("e0")
    write(index, slot, Medium.GPU, [11, 12])
    context = multiprocessing.get_context("spawn")
    answer = context.Queue()
    reader = context.Process(target=_read_in_another_process, args=(index.path, [11, 12, 13], answer))
    reader.start()
    try:
        assert answer.get(timeout=60) == ({"e0": slot}, [1, 1, 0])
    finally:
        reader.join(30)
        index.close()


# --- a model of what the index must hold, against random event streams through a feed ---

UNIVERSE = list(range(1, 49))  # block hashes; the test index has 64 rows
_MEDIA_NAMES = ["GPU", "CPU", "STORAGE"]
_EVENTS = st.lists(st.one_of(
    st.tuples(st.just("store"), st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True),
              st.sampled_from(_MEDIA_NAMES)),
    st.tuples(st.just("remove"), st.lists(st.sampled_from(UNIVERSE), min_size=1, max_size=6, unique=True),
              st.sampled_from(_MEDIA_NAMES)),
    st.tuples(st.just("clear"), st.just([]), st.just("GPU")),
), max_size=40)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_EVENTS, st.sampled_from(["map", "array"]))
def test_random_event_streams_leave_exactly_what_the_engine_holds(events, encoding):
    index = EventsIndex.create(4 * 1024, 8)
    assert index.capacity == 64
    context = zmq.asyncio.Context()
    metrics = kv_events_metrics(CollectorRegistry())
    config = InstanceConfig(id="e0", url="http://127.0.0.1:9", model="m", kv_events_endpoint="tcp://127.0.0.1:1")
    feed = InstanceFeed(config, index.take_slot("e0"), index, VllmDecoder(), FeedLimits(b"", BLOCK, 10**6, 1.0),
                        metrics, context)
    held: dict[int, set[str]] = {}
    payloads = []
    for kind, keys, medium in events:
        if kind == "store":
            payloads.append([stored(keys, None, [0] * BLOCK * len(keys), BLOCK, medium=medium, encoding=encoding)])
            for key in keys:
                held.setdefault(key, set()).add(medium)
        elif kind == "remove":
            payloads.append([removed(keys, medium=medium, encoding=encoding)])
            for key in keys:
                held.get(key, set()).discard(medium)
        else:
            payloads.append([cleared(encoding)])
            held.clear()

    async def feed_all() -> None:
        for seq, batch in enumerate(payloads):
            await feed.receive([b"", seq.to_bytes(8, "big"), batch_payload(batch)])

    try:
        asyncio.run(feed_all())
        found = index.lookup(np.array(UNIVERSE, dtype=np.uint64))
        assert found is not None
        for key, bits in zip(UNIVERSE, found.tolist(), strict=True):
            assert {name for name, word in zip(_MEDIA_NAMES, bits, strict=True) if word} == held.get(key, set())
        assert index.blocks(feed.slot) == tuple(sum(1 for media in held.values() if name in media)
                                                for name in _MEDIA_NAMES)
    finally:
        context.term()
        index.close()
