"""The events subscriber against engines' real ZMQ sockets over loopback (tests/kv_events_engine.py):
what the index holds after stores, removals, gaps, replays, restarts and garbage."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from prometheus_client import CollectorRegistry

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.kvs_client.events.index import EventsIndex, FeedState
from kvgate.kvs_client.events.subscriber import EventsSubscriber
from kvgate.kvs_client.events.view import EventsView
from kvgate.metrics.definitions import kv_events_metrics
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.tiers import EnginePrefix
from tests.gateway_helpers import wait_until
from tests.kv_events_engine import FakeEventsEngine, batch_payload, cleared, removed, stored

pytestmark = pytest.mark.timeout(60)

BLOCK = 16
PROMPT = list(range(1000, 1000 + 4 * BLOCK))  # four full blocks
OTHER = list(range(5000, 5000 + 2 * BLOCK))


class Fleet:
    """A subscriber following fake engines, and the view the request path would read."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.prometheus = CollectorRegistry()
        self.index = EventsIndex.create(2 * 1024 * 1024, 8)
        self.instances: dict[str, tuple[InstanceConfig, bool]] = {}
        self.subscriber = EventsSubscriber(self.index, settings, kv_events_metrics(self.prometheus),
                                           lambda: list(self.instances.values()))
        self.view = EventsView(self.index)

    def follow(self, instance_id: str, engine: FakeEventsEngine, replay: bool = True, active: bool = True) -> None:
        config = InstanceConfig(id=instance_id, url="http://127.0.0.1:9", model="m",
                                kv_events_endpoint=engine.endpoint,
                                kv_events_replay_endpoint=engine.replay_endpoint if replay else "")
        self.instances[instance_id] = (config, active)
        self.subscriber.sync()

    def hits(self, tokens: list[int]) -> dict[str, EnginePrefix]:
        found = self.view.hits(hash_blocks("sha256_cbor", tokens, BLOCK))
        assert found is not None
        return dict(found.prefixes)

    def state(self, instance_id: str) -> FeedState:
        return self.view.states()[instance_id]

    def metric(self, name: str, **labels: str) -> float:
        return self.prometheus.get_sample_value(name, labels) or 0.0

    async def until_applied(self, instance_id: str, seq: int) -> None:
        slot = self.view.slots()[instance_id]
        await wait_until(lambda: self.index.state(slot) != FeedState.SILENT and self.index.last_seq(slot) >= seq)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    fleet = Fleet(Settings(kvs_chunk_size=BLOCK, kv_events_topic="kv-events", kv_events_replay_timeout_s=2.0))
    yield fleet
    await fleet.subscriber.close()
    fleet.index.close()


@pytest.fixture
async def engines() -> AsyncIterator[list[FakeEventsEngine]]:
    started: list[FakeEventsEngine] = []
    yield started
    for engine in started:
        await engine.close()


async def start(engines: list[FakeEventsEngine], **options) -> FakeEventsEngine:
    engine = await FakeEventsEngine(block_size=BLOCK, **options).start()
    engines.append(engine)
    return engine


async def start_followed(fleet: Fleet, engines: list[FakeEventsEngine], *instance_ids: str, replay: bool = True,
                         **options) -> list[FakeEventsEngine]:
    """Engines started and followed as `instance_ids`, once each one's subscription is open."""
    started = [await start(engines, replay=replay, **options) for _ in instance_ids]
    for instance_id, engine in zip(instance_ids, started, strict=True):
        fleet.follow(instance_id, engine, replay=replay)
    for engine in started:
        await engine.wait_subscribed()
    return started


async def store_first_prompts(fleet: Fleet, prompts: dict[str, tuple[FakeEventsEngine, list[int]]]) -> None:
    """Each engine publishes its prompt's blocks as its first batch, which the fleet then applies."""
    for engine, prompt in prompts.values():
        await engine.publish([engine.store_prompt(prompt)])
    for instance_id in prompts:
        await fleet.until_applied(instance_id, 0)


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("int_hashes", [True, False])
async def test_stores_and_removals_show_on_their_instance_only(fleet, engines, encoding, int_hashes):
    e0, e1 = await start_followed(fleet, engines, "e0", "e1", encoding=encoding, int_hashes=int_hashes)

    await store_first_prompts(fleet, {"e0": (e0, PROMPT), "e1": (e1, OTHER)})
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(4 * BLOCK)}
    assert fleet.hits(OTHER) == {"e1": EnginePrefix(2 * BLOCK)}
    assert fleet.state("e0") == FeedState.SYNCED

    hashes = e0.hashes(PROMPT)
    # The last two blocks leave the GPU for the CPU tier: same prefix, priced as a host load.
    await e0.publish([removed(hashes[2:], encoding=encoding),
                      stored(hashes[2:], hashes[1], PROMPT[2 * BLOCK :], BLOCK, medium="CPU", encoding=encoding)])
    await fleet.until_applied("e0", 1)
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(2 * BLOCK, 2 * BLOCK)}
    assert fleet.index.blocks(fleet.view.slots()["e0"]) == (2, 2, 0)
    assert fleet.metric("kvgate_kv_events_blocks", instance="e0", medium="CPU") == 2
    assert fleet.metric("kvgate_kv_events_lag_seconds_count") >= 3  # every batch applied, both engines

    await e0.publish([removed(hashes[1:2], encoding=encoding)])  # a hole ends the prefix
    await fleet.until_applied("e0", 2)
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(BLOCK)}

    await e0.publish([cleared(encoding)])
    await fleet.until_applied("e0", 3)
    assert fleet.hits(PROMPT) == {}
    assert fleet.hits(OTHER) == {"e1": EnginePrefix(2 * BLOCK)}
    assert fleet.metric("kvgate_kv_events_applied_total", instance="e0") == 5
    assert fleet.metric("kvgate_kv_events_resets_total", instance="e0", reason="cleared") == 1


async def test_a_gap_is_replayed_from_the_last_sequence_seen(fleet, engines):
    [engine] = await start_followed(fleet, engines, "e0")
    hashes = engine.hashes(PROMPT)
    await engine.publish([engine.store_prompt(PROMPT[: 2 * BLOCK])])
    await engine.publish([engine.store_prompt(PROMPT, skip=2)], send=False)  # lost on the way
    await engine.publish([removed(hashes[:1])], send=False)
    await engine.publish([engine.store_prompt(PROMPT[:BLOCK])])
    await fleet.until_applied("e0", 3)
    assert engine.replay_requests == [1]
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(4 * BLOCK)}
    assert fleet.state("e0") == FeedState.SYNCED
    assert fleet.metric("kvgate_kv_events_gaps_total", instance="e0") == 1
    assert fleet.metric("kvgate_kv_events_replays_total", instance="e0", outcome="repaired") == 1


async def test_a_gap_without_replay_forgets_what_may_be_stale(fleet, engines):
    [engine] = await start_followed(fleet, engines, "e0", replay=False)
    await engine.publish([engine.store_prompt(PROMPT)])
    await fleet.until_applied("e0", 0)
    # The engine evicts the prompt, but the subscriber never hears of it.
    await engine.publish([removed(engine.hashes(PROMPT))], send=False)
    await engine.publish([engine.store_prompt(OTHER)])
    await fleet.until_applied("e0", 2)
    assert fleet.hits(PROMPT) == {}
    assert fleet.hits(OTHER) == {"e0": EnginePrefix(2 * BLOCK)}
    assert fleet.state("e0") == FeedState.PARTIAL
    assert fleet.metric("kvgate_kv_events_resets_total", instance="e0", reason="gap") == 1


async def test_joining_late_replays_the_whole_history(fleet, engines):
    engine = await start(engines)
    await engine.publish([engine.store_prompt(PROMPT)], send=False)  # before kvgate listened
    await engine.publish([engine.store_prompt(OTHER)], send=False)
    fleet.follow("e0", engine)
    await engine.wait_subscribed()
    assert fleet.state("e0") == FeedState.SILENT
    assert fleet.view.unknown() == {"e0"}
    await engine.publish([removed(engine.hashes(OTHER)[1:])])
    await fleet.until_applied("e0", 2)
    assert engine.replay_requests == [0]
    assert fleet.state("e0") == FeedState.SYNCED
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(4 * BLOCK)}
    assert fleet.hits(OTHER) == {"e0": EnginePrefix(BLOCK)}


async def test_an_engine_that_dies_and_comes_back_starts_over(fleet, engines):
    [engine] = await start_followed(fleet, engines, "e0")
    await engine.publish([engine.store_prompt(PROMPT)])
    await engine.publish([engine.store_prompt(OTHER)])
    await fleet.until_applied("e0", 1)
    port, replay_port = engine.port, engine.replay_port
    await engine.close()
    engines.remove(engine)

    # A new engine process on the same ports: its numbering restarts at 0, its cache is empty.
    reborn = await FakeEventsEngine(block_size=BLOCK).start(port, replay_port)
    engines.append(reborn)
    await reborn.wait_subscribed()  # the SUB socket reconnects by itself
    await reborn.publish([reborn.store_prompt(OTHER[:BLOCK])])
    await wait_until(lambda: fleet.metric("kvgate_kv_events_resets_total", instance="e0", reason="restart") == 1)
    await fleet.until_applied("e0", 0)
    assert fleet.hits(PROMPT) == {}
    assert fleet.hits(OTHER) == {"e0": EnginePrefix(BLOCK)}
    assert fleet.state("e0") == FeedState.SYNCED


async def test_a_restart_after_a_replay_is_still_a_restart(fleet, engines):
    """The replay at joining covered batches 0..2; later, a restarted engine numbers from 0 again:
    its batches are a restart, not duplicates of what the replay applied."""
    engine = await start(engines)
    for _ in range(3):
        await engine.publish([engine.store_prompt(PROMPT)], send=False)  # before kvgate listened
    fleet.follow("e0", engine)
    await engine.wait_subscribed()
    await engine.publish([engine.store_prompt(OTHER)])
    await engine.publish([removed(engine.hashes(OTHER)[1:])])
    await fleet.until_applied("e0", 4)
    assert engine.replay_requests == [0]
    port, replay_port = engine.port, engine.replay_port
    await engine.close()
    engines.remove(engine)

    reborn = await FakeEventsEngine(block_size=BLOCK).start(port, replay_port)
    engines.append(reborn)
    await reborn.wait_subscribed()
    await reborn.publish([reborn.store_prompt(OTHER)])
    await wait_until(lambda: fleet.metric("kvgate_kv_events_resets_total", instance="e0", reason="restart") == 1)
    await fleet.until_applied("e0", 0)
    assert fleet.hits(PROMPT) == {}
    assert fleet.hits(OTHER) == {"e0": EnginePrefix(2 * BLOCK)}


async def test_a_block_whose_parent_is_unknown_is_indexed_but_no_prefix_starts_there(fleet, engines):
    [engine] = await start_followed(fleet, engines, "e0")
    await engine.publish([engine.store_prompt(PROMPT, skip=2)])
    await fleet.until_applied("e0", 0)
    assert fleet.metric("kvgate_kv_events_orphan_blocks_total", instance="e0") == 2
    assert fleet.hits(PROMPT) == {}  # a prefix starts at block 0
    await engine.publish([engine.store_prompt(PROMPT[: 2 * BLOCK])])
    await fleet.until_applied("e0", 1)
    assert fleet.hits(PROMPT) == {"e0": EnginePrefix(4 * BLOCK)}


async def test_an_engine_that_never_publishes_is_unknown_not_empty(fleet, engines):
    quiet, talking = await start(engines), await start(engines)
    fleet.follow("quiet", quiet)
    fleet.follow("talking", talking)
    await talking.wait_subscribed()
    await talking.publish([talking.store_prompt(PROMPT)])
    await fleet.until_applied("talking", 0)
    found = fleet.view.hits(hash_blocks("sha256_cbor", PROMPT, BLOCK))
    assert found is not None
    assert found.unknown == {"quiet"}
    assert dict(found.prefixes) == {"talking": EnginePrefix(4 * BLOCK)}
    fleet.subscriber.sync()
    assert fleet.metric("kvgate_kv_events_silent_instances") == 1
    assert fleet.metric("kvgate_kv_events_subscriptions") == 2


async def test_garbage_is_counted_and_dropped_and_the_feed_goes_on(fleet, engines):
    [engine] = await start_followed(fleet, engines, "e0", replay=False)
    await engine.publish([engine.store_prompt(PROMPT)])
    await fleet.until_applied("e0", 0)
    await engine.publish([], payload=b"\xc1 not msgpack")
    await engine._pub.send_multipart([b"kv-events", b"short"])  # a sequence that is not 8 bytes
    await engine._pub.send_multipart([b"kv-events"])
    await engine.publish([], payload=batch_payload([{"type": "BlockStored", "block_hashes": "nope"}]))
    # Events the index has no use for: another block size, an image's, another KV cache group's.
    await engine.publish([stored([1], None, [0] * 32, 32),
                          stored([2], None, list(range(BLOCK)), BLOCK, extra_keys=[[["image-sha", 0]]]),
                          stored([3], None, list(range(BLOCK)), BLOCK, group_idx=1),
                          {"type": "SomethingNew"}])
    await engine.publish([engine.store_prompt(OTHER)])
    await fleet.until_applied("e0", 4)
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="not_msgpack") == 1
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="bad_frames") == 2
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="bad_event") == 1
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="block_size") == 1
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="keyed_beyond_tokens") == 1
    assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="ignored") == 2
    # An unreadable batch may have removed anything: what was held before it is forgotten.
    assert fleet.hits(PROMPT) == {}
    assert fleet.hits(OTHER) == {"e0": EnginePrefix(2 * BLOCK)}
    assert fleet.index.blocks(fleet.view.slots()["e0"]) == (2, 0, 0)


async def test_removed_drained_or_ejected_instances_are_forgotten(fleet, engines):
    e0, e1 = await start_followed(fleet, engines, "e0", "e1")
    await store_first_prompts(fleet, {"e0": (e0, PROMPT), "e1": (e1, PROMPT)})
    assert set(fleet.hits(PROMPT)) == {"e0", "e1"}

    fleet.follow("e1", e1, active=False)  # drained or ejected
    del fleet.instances["e0"]  # removed
    fleet.subscriber.sync()
    assert fleet.hits(PROMPT) == {}
    assert fleet.view.slots() == {}
    await wait_until(lambda: e0.connections == 0 and e1.connections == 0)

    fleet.follow("e1", e1)  # back in service: its cache is unknown until it speaks
    assert fleet.view.unknown() == {"e1"}
    await e1.wait_subscribed()
    await e1.publish([e1.store_prompt(OTHER)])
    await fleet.until_applied("e1", 1)
    assert fleet.hits(OTHER) == {"e1": EnginePrefix(2 * BLOCK)}


async def test_a_full_instance_cap_drops_further_blocks(engines):
    fleet = Fleet(Settings(kvs_chunk_size=BLOCK, kv_events_max_blocks_per_instance=3))
    try:
        [engine] = await start_followed(fleet, engines, "e0", replay=False)
        await engine.publish([engine.store_prompt(PROMPT)])
        await fleet.until_applied("e0", 0)
        assert fleet.hits(PROMPT) == {"e0": EnginePrefix(3 * BLOCK)}
        assert fleet.metric("kvgate_kv_events_dropped_total", instance="e0", reason="index_full") == 1
        assert fleet.state("e0") == FeedState.PARTIAL
    finally:
        await fleet.subscriber.close()
        fleet.index.close()


async def test_the_subscriber_follows_the_fleet_until_cancelled(fleet, engines):
    engine = await start(engines)
    task = asyncio.create_task(fleet.subscriber.run())
    try:
        config = InstanceConfig(id="e0", url="http://127.0.0.1:9", model="m", kv_events_endpoint=engine.endpoint)
        fleet.instances["e0"] = (config, True)  # an admin add: picked up by the next sync
        await engine.wait_subscribed()
        await engine.publish([engine.store_prompt(PROMPT)])
        await wait_until(lambda: fleet.hits(PROMPT) == {"e0": EnginePrefix(4 * BLOCK)})
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    await wait_until(lambda: engine.connections == 0)
