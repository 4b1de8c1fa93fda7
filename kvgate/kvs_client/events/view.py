"""The request path's side of the events index: a prompt's blocks -> what each engine holds.

Every worker reads the one index its gateway's subscriber writes (index.py): one probe sequence per
prompt block, whatever the fleet's size, then a walk down the columns of the instances holding the
first block. Nothing here blocks or allocates in proportion to the index.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgate.kvs_client.events.base import Medium
from kvgate.kvs_client.events.index import EventsIndex, FeedState
from kvgate.kvs_client.events.keys import prompt_keys
from kvgate.metrics.definitions import KVEventsLookupMetrics
from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.tiers import EngineHits, EnginePrefix


class EventsView:
    def __init__(self, index: EventsIndex, metrics: KVEventsLookupMetrics | None = None) -> None:
        self.index = index
        self._metrics = metrics
        self._outcomes = {outcome: metrics.lookups.labels(outcome) for outcome in ("hit", "miss", "busy")} \
            if metrics else {}
        self._epoch = -1
        self._slots: dict[str, int] = {}
        self._ids: dict[int, str] = {}
        self._unknown: frozenset[str] = frozenset()

    def slots(self) -> dict[str, int]:
        """Instance id -> index slot, for instances whose events kvgate follows."""
        self._refresh()
        return self._slots

    def states(self) -> dict[str, FeedState]:
        """Every followed instance's feed state (for /debug/schedule and operators)."""
        return {instance_id: self.index.state(slot) for instance_id, slot in self.slots().items()}

    def unknown(self) -> frozenset[str]:
        """Followed instances that have said nothing since kvgate connected (SILENT)."""
        self._refresh()
        return self._unknown

    def _refresh(self) -> None:
        """Re-read the slots and who is unknown when the epoch moved (rarely: the fleet or a feed
        state changed), so a request reads one word of them."""
        if self.index.epoch == self._epoch:
            return
        # The epoch first: a change racing this read moves it again, and the next read redoes it.
        self._epoch = self.index.epoch
        self._slots = self.index.instance_slots()
        self._ids = {slot: instance_id for instance_id, slot in self._slots.items()}
        self._unknown = frozenset(instance_id for instance_id, slot in self._slots.items()
                                  if self.index.state(slot) == FeedState.SILENT)

    def hits(self, blocks: Sequence[BlockHash]) -> EngineHits | None:
        """What the engines hold of these blocks; None when the index was too busy to read."""
        keys = prompt_keys(blocks)
        unknown = self.unknown()
        if not keys.size:
            return EngineHits({}, unknown)
        found = self.index.lookup(keys)
        if found is None:
            self._count("busy")
            return None
        words = self.index.words
        held = found[:, :words] | found[:, words : 2 * words] | found[:, 2 * words :]
        # The instances holding block 0 are the only ones with a prefix: walk their columns alone.
        first = held[0]
        if not first.any():
            self._count("miss")
            return EngineHits({}, unknown)
        ids = self._ids  # refreshed by unknown() above
        holders = [(slot, instance_id) for slot in _set_bits(first) if (instance_id := ids.get(slot)) is not None]
        self._count("hit")
        if not holders:  # slots taken after this worker last read the ids: they show next time
            return EngineHits({}, unknown)
        chunk = blocks[0].num_tokens  # every indexed block is full
        return EngineHits(_prefixes(found, held, words, holders, chunk), unknown)

    def _count(self, outcome: str) -> None:
        if self._outcomes:
            self._outcomes[outcome].inc()


def _set_bits(words: np.ndarray) -> list[int]:
    """Slots whose bit is set in a bitmap."""
    slots = []
    for word in np.flatnonzero(words).tolist():
        bits = int(words[word])
        while bits:
            low = bits & -bits
            bits ^= low
            slots.append(word * 64 + low.bit_length() - 1)
    return slots


def _prefixes(found: np.ndarray, held: np.ndarray, words: int, holders: list[tuple[int, str]],
              chunk: int) -> dict[str, EnginePrefix]:
    """Each holder's contiguous prefix, each block in its cheapest medium: one pass for all of them."""
    slots = np.array([slot for slot, _ in holders])
    column, shift = slots // 64, (slots % 64).astype(np.uint64)

    def bits(table: np.ndarray) -> np.ndarray:  # (blocks, holders) booleans
        return ((table[:, column] >> shift) & np.uint64(1)).astype(bool)

    prefix = np.logical_and.accumulate(bits(held), axis=0)
    gpu = bits(found[:, Medium.GPU * words : (Medium.GPU + 1) * words]) & prefix
    cpu = bits(found[:, Medium.CPU * words : (Medium.CPU + 1) * words]) & prefix & ~gpu
    lengths, gpu_blocks, cpu_blocks = prefix.sum(axis=0), gpu.sum(axis=0), cpu.sum(axis=0)
    return {
        instance_id: EnginePrefix(int(gpu_blocks[i]) * chunk, int(cpu_blocks[i]) * chunk,
                                  int(lengths[i] - gpu_blocks[i] - cpu_blocks[i]) * chunk)
        for i, (_, instance_id) in enumerate(holders)
    }
