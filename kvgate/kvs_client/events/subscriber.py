"""Follow every publishing instance's KV events into the index (one subscriber per gateway machine).

Each instance with a `kv_events_endpoint` gets its own SUB socket (kvgate connects; the engine binds),
so its messages stay in order and are told apart by socket. A message is three frames: topic, an
8-byte big-endian sequence number, the payload (decoded by the configured format's decoder).

What the sequence numbers say, and what the index does (docs/KV_EVENTS.md):
- the first message since connecting: seq 0 is a fresh engine (its whole history follows: SYNCED);
  a later seq means kvgate joined late, so it asks the replay socket (when configured) for
  everything from 0; what it cannot get back makes the instance PARTIAL (what it reports is true,
  older blocks may be missing);
- the next seq: applied;
- a jump forward (a gap): the missing batches are replayed from the last seq seen; if they cannot
  all be, the instance's blocks are forgotten (a missed removal could make any of them wrong) and
  it goes on PARTIAL from there;
- a step back: the engine restarted (its numbering starts again at 0): everything is forgotten;
- an unreadable payload: counted, and handled as a gap that no replay can repair.
An instance that has sent nothing since kvgate connected is SILENT: its cache is unknown.
Instances removed, drained or ejected are unsubscribed and forgotten; one that comes back starts over.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.kvs_client.events import DECODERS
from kvgate.kvs_client.events.base import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    EventDecoder,
    MalformedEvents,
    Medium,
)
from kvgate.kvs_client.events.index import EventsIndex, FeedState
from kvgate.metrics.definitions import KVEventsMetrics

log = logging.getLogger(__name__)

# The replay socket's end marker: sequence -1 (as 8 signed big-endian bytes), empty payload.
_END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
# Longest payload accepted from an engine; a larger message is dropped by ZMQ itself.
_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_SYNC_INTERVAL_S = 0.5

# (instance config, whether it is active: neither draining nor ejected)
InstanceSource = Callable[[], Iterable[tuple[InstanceConfig, bool]]]


@dataclass(frozen=True, slots=True)
class FeedLimits:
    topic: bytes
    block_size: int  # kvgate's chunk size: stores of another block size never match a prompt
    max_blocks: int
    replay_timeout_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> FeedLimits:
        return cls(settings.kv_events_topic.encode(), settings.kvs_chunk_size,
                   settings.kv_events_max_blocks_per_instance, settings.kv_events_replay_timeout_s)


class InstanceFeed:
    """One instance's events: its socket, its sequence, its slot in the index."""

    def __init__(self, config: InstanceConfig, slot: int, index: EventsIndex, decoder: EventDecoder,
                 limits: FeedLimits, metrics: KVEventsMetrics, context: zmq.asyncio.Context) -> None:
        self.config = config
        self.slot = slot
        self._index = index
        self._decoder = decoder
        self._limits = limits
        self._metrics = metrics
        self._context = context
        self._id = config.id
        self._last: int | None = None  # last sequence number applied
        # Live messages queued behind the one that started a replay, (after, through]: applied by the
        # replay already. Only those: an engine that restarts later also sends numbers below `through`.
        self._replayed: tuple[int, int] | None = None
        self._socket: zmq.asyncio.Socket | None = None

    @property
    def state(self) -> FeedState:
        return self._index.state(self.slot)

    async def run(self) -> None:
        socket = self._socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.SUBSCRIBE, self._limits.topic)
        socket.connect(self.config.kv_events_endpoint)
        try:
            while True:
                frames = await socket.recv_multipart()
                try:
                    await self.receive(frames)
                except asyncio.CancelledError:
                    raise
                except Exception:  # a bug here must cost this message, never the subscriber
                    log.exception("KV events of %s: message not applied", self._id)
                    self._metrics.dropped.labels(self._id, "error").inc()
        finally:
            socket.close(linger=0)

    async def receive(self, frames: list[bytes]) -> None:
        """One message (topic, seq, payload) from the live socket."""
        if len(frames) != 3 or len(frames[1]) != 8:
            self._metrics.dropped.labels(self._id, "bad_frames").inc()
            return
        self._metrics.received.labels(self._id).inc()
        await self._sequence(int.from_bytes(frames[1], "big"), frames[2])

    async def _sequence(self, seq: int, payload: bytes, replaying: bool = False) -> None:
        """Apply, replay, reset or skip, as the sequence number says (module docstring)."""
        if self._last is None:
            if seq != 0 and self.config.kv_events_replay_endpoint and not replaying:
                await self._replay(0, (seq, payload))
                return
            self._index.set_state(self.slot, FeedState.SYNCED if seq == 0 else FeedState.PARTIAL)
            self._apply(seq, payload)
        elif seq == self._last + 1:
            self._replayed = None  # past the replayed window: a step back is a restart again
            self._apply(seq, payload)
        elif seq <= self._last:
            if self._replayed is not None and self._replayed[0] < seq <= self._replayed[1]:
                self._metrics.dropped.labels(self._id, "duplicate").inc()
                return
            log.warning("KV events of %s: sequence went back from %d to %d (engine restart): forgetting its "
                        "blocks", self._id, self._last, seq)
            self._reset("restart", FeedState.SILENT)
            await self._sequence(seq, payload, replaying)
        else:
            self._metrics.gaps.labels(self._id).inc()
            if self.config.kv_events_replay_endpoint and not replaying:
                await self._replay(self._last + 1, (seq, payload))
                return
            log.warning("KV events of %s: batches %d..%d missed: forgetting its blocks", self._id, self._last + 1,
                        seq - 1)
            self._reset("gap", FeedState.PARTIAL)
            self._apply(seq, payload)

    async def _replay(self, start: int, live: tuple[int, bytes]) -> None:
        """Ask the engine for every batch from `start`, apply them, then the live message that
        showed they were missing."""
        batches = await self._ask_replay(start)
        complete = bool(batches) and batches[0][0] == start
        outcome = "repaired" if complete else "failed" if batches is None else "incomplete"
        self._metrics.replays.labels(self._id, outcome).inc()
        if start == 0:  # joining: the whole history, or what is left of it
            self._index.set_state(self.slot, FeedState.SYNCED if complete else FeedState.PARTIAL)
        elif not complete:
            log.warning("KV events of %s: replay from %d %s: forgetting its blocks", self._id, start, outcome)
            self._reset("gap", FeedState.PARTIAL)
        for seq, payload in batches or ():
            if self._last is None or seq > self._last:
                self._apply(seq, payload)
        seq, payload = live
        if self._last is not None:
            self._replayed = (seq, self._last)
        if self._last is None or seq > self._last:
            await self._sequence(seq, payload, replaying=True)

    async def _ask_replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The engine's buffered batches from `start` in order, or None when it did not answer in time."""
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.MAXMSGSIZE, _MAX_MESSAGE_BYTES)
        batches: list[tuple[int, bytes]] = []
        try:
            dealer.connect(self.config.kv_events_replay_endpoint)
            async with asyncio.timeout(self._limits.replay_timeout_s):
                await dealer.send_multipart([b"", start.to_bytes(8, "big")])
                while True:
                    frames = await dealer.recv_multipart()
                    # ["", topic, seq, payload]; the end marker has seq -1 and an empty payload.
                    if len(frames) != 4 or len(frames[2]) != 8:
                        self._metrics.dropped.labels(self._id, "bad_frames").inc()
                        continue
                    if frames[2] == _END_OF_REPLAY:
                        return batches
                    self._metrics.received.labels(self._id).inc()
                    batches.append((int.from_bytes(frames[2], "big"), frames[3]))
        except (TimeoutError, zmq.ZMQError) as exc:
            log.warning("KV events of %s: replay from %d failed (%s); %d batch(es) received", self._id, start,
                        type(exc).__name__, len(batches))
            return batches or None
        finally:
            dealer.close(linger=0)

    def _apply(self, seq: int, payload: bytes) -> None:
        self._last = seq
        self._index.note_seq(self.slot, seq)
        try:
            batch = self._decoder.decode(payload)
        except MalformedEvents as exc:
            self._metrics.dropped.labels(self._id, exc.reason).inc()
            log.warning("KV events of %s: batch %d unreadable (%s): forgetting its blocks", self._id, seq, exc)
            self._reset("malformed", FeedState.PARTIAL)
            return
        lag = time.time() - batch.timestamp
        if lag >= 0:
            self._metrics.lag_seconds.observe(lag)
        if batch.ignored:
            self._metrics.dropped.labels(self._id, "ignored").inc(batch.ignored)
        self._apply_batch(batch)
        self._metrics.applied.labels(self._id).inc(len(batch.events))
        self.publish_blocks()

    def _apply_batch(self, batch: EventBatch) -> None:
        index, slot = self._index, self.slot
        index.begin()
        try:
            for event in batch.events:
                if isinstance(event, BlocksStored):
                    self._store(event)
                elif isinstance(event, BlocksRemoved):
                    index.remove(slot, event.medium, event.hashes)
                elif isinstance(event, AllCleared):
                    index.forget(slot)
                    self._metrics.resets.labels(self._id, "cleared").inc()
                    index.set_state(slot, FeedState.SYNCED)  # an empty cache is a whole picture
        finally:
            index.end()

    def _store(self, event: BlocksStored) -> None:
        if event.block_size != self._limits.block_size:
            self._metrics.dropped.labels(self._id, "block_size").inc()
            return
        if event.keyed_beyond_tokens:  # images, prompt embeddings: no prompt kvgate hashes can match
            self._metrics.dropped.labels(self._id, "keyed_beyond_tokens").inc()
            return
        if event.parent is not None and not self._index.holds(self.slot, event.parent):
            self._metrics.orphans.labels(self._id).inc(len(event.hashes))
        refused = self._index.store(self.slot, event.medium, event.hashes, self._limits.max_blocks)
        if refused:
            self._metrics.dropped.labels(self._id, "index_full").inc(refused)
            self._index.set_state(self.slot, FeedState.PARTIAL)

    def _reset(self, reason: str, state: FeedState) -> None:
        self._index.forget(self.slot)
        self._index.set_state(self.slot, state)
        self._metrics.resets.labels(self._id, reason).inc()
        if state == FeedState.SILENT:
            self._last = None
        self._replayed = None
        self.publish_blocks()

    def publish_blocks(self) -> None:
        for medium, count in zip(Medium, self._index.blocks(self.slot), strict=True):
            self._metrics.blocks.labels(self._id, medium.name).set(count)


class EventsSubscriber:
    """Every active publishing instance's feed, following the fleet as `instances` reports it."""

    def __init__(self, index: EventsIndex, settings: Settings, metrics: KVEventsMetrics,
                 instances: InstanceSource) -> None:
        self.index = index
        self._decoder = DECODERS[settings.kv_events_format]()
        self._limits = FeedLimits.from_settings(settings)
        self._metrics = metrics
        self._instances = instances
        self._context = zmq.asyncio.Context()
        self._feeds: dict[str, tuple[InstanceFeed, asyncio.Task[None]]] = {}
        self._no_slot_logged: set[str] = set()
        # A restarted subscriber knows nothing of what its predecessor applied: start clean.
        for slot in index.instance_slots().values():
            index.free_slot(slot)
        metrics.index_rows.labels("capacity").set(index.capacity)

    def sync(self) -> None:
        """Subscribe to new or returning instances, unsubscribe from gone, drained or ejected ones."""
        wanted = {config.id: config for config, active in self._instances() if active and config.kv_events_endpoint}
        for instance_id, (feed, _) in list(self._feeds.items()):
            if wanted.get(instance_id) != feed.config:
                self._stop(instance_id)
        for instance_id, config in wanted.items():
            if instance_id not in self._feeds:
                self._start(config)
        silent = sum(1 for feed, _ in self._feeds.values() if feed.state == FeedState.SILENT)
        self._metrics.silent_instances.set(silent)
        self._metrics.subscriptions.set(len(self._feeds))
        self._metrics.index_rows.labels("used").set(self.index.occupied)

    async def run(self) -> None:
        """Follow the fleet until cancelled."""
        try:
            while True:
                self.sync()
                await asyncio.sleep(_SYNC_INTERVAL_S)
        finally:
            await self.close()

    async def close(self) -> None:
        if self._context.closed:
            return
        tasks = [task for _, task in self._feeds.values()]
        for instance_id in list(self._feeds):
            self._stop(instance_id)
        await asyncio.gather(*tasks, return_exceptions=True)
        self._context.term()

    def _start(self, config: InstanceConfig) -> None:
        slot = self.index.take_slot(config.id)
        if slot is None:
            if config.id not in self._no_slot_logged:
                self._no_slot_logged.add(config.id)
                log.warning("KV events of %s not followed: all %d slots of the index are taken "
                            "(raise --kv-events-max-instances)", config.id, self.index.slots)
            return
        feed = InstanceFeed(config, slot, self.index, self._decoder, self._limits, self._metrics, self._context)
        self._feeds[config.id] = feed, asyncio.create_task(feed.run(), name=f"kv-events-{config.id}")
        feed.publish_blocks()
        log.info("KV events of %s: subscribed to %s", config.id, config.kv_events_endpoint)

    def _stop(self, instance_id: str) -> None:
        feed, task = self._feeds.pop(instance_id)
        task.cancel()
        if any(self.index.blocks(feed.slot)):
            self._metrics.resets.labels(instance_id, "stopped").inc()
        self.index.free_slot(feed.slot)
        for medium in Medium:
            with contextlib.suppress(KeyError):
                self._metrics.blocks.remove(instance_id, medium.name)
