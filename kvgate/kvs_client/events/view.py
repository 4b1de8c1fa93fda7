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

    def slots(self) -> dict[str, int]:
        """Instance id -> index slot, for instances whose events kvgate follows."""
        if self.index.epoch != self._epoch:
            # The epoch first: a slot change racing this read moves it again, and the next read redoes it.
            self._epoch = self.index.epoch
            self._slots = self.index.instance_slots()
            self._ids = {slot: instance_id for instance_id, slot in self._slots.items()}
        return self._slots

    def states(self) -> dict[str, FeedState]:
        """Every followed instance's feed state (for /debug/schedule and operators)."""
        return {instance_id: self.index.state(slot) for instance_id, slot in self.slots().items()}

    def unknown(self) -> frozenset[str]:
        return frozenset(instance_id for instance_id, state in self.states().items() if state == FeedState.SILENT)

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
        # Column by column, the instances holding every block so far; row 0's are the candidates.
        first = held[0]
        if not first.any():
            self._count("miss")
            return EngineHits({}, unknown)
        chunk = blocks[0].num_tokens  # every indexed block is full
        ids = self._ids  # refreshed by unknown() above
        prefixes: dict[str, EnginePrefix] = {}
        for word in np.nonzero(first)[0]:
            bits = int(first[word])
            while bits:
                low = bits & -bits
                bits ^= low
                slot = int(word) * 64 + low.bit_length() - 1
                instance_id = ids.get(slot)
                if instance_id is None:
                    continue  # a slot taken after this worker last read the ids: it shows next time
                prefixes[instance_id] = _prefix(found, held, words, int(word), np.uint64(low), chunk)
        self._count("hit")
        return EngineHits(prefixes, unknown)

    def _count(self, outcome: str) -> None:
        if self._outcomes:
            self._outcomes[outcome].inc()


def _prefix(found: np.ndarray, held: np.ndarray, words: int, word: int, bit: np.uint64, chunk: int) -> EnginePrefix:
    """One instance's contiguous prefix, each block in its cheapest medium."""
    column = (held[:, word] & bit) != 0
    length = int(column.argmin()) if not column.all() else len(column)
    gpu = (found[:length, Medium.GPU * words + word] & bit) != 0
    cpu = ~gpu & ((found[:length, Medium.CPU * words + word] & bit) != 0)
    gpu_blocks, cpu_blocks = int(gpu.sum()), int(cpu.sum())
    return EnginePrefix(gpu_blocks * chunk, cpu_blocks * chunk, (length - gpu_blocks - cpu_blocks) * chunk)
