"""The events index: block key -> which instances hold the block, in which medium.

One block of memory (a file in /dev/shm shared by every worker of `kvgate serve --workers N`, or
anonymous memory in a single-process gateway), laid out as uint64 words:

    header     seq | capacity | bitmap words | instance slots | occupied rows | epoch | 2 spare
    instances  per slot: state | blocks per medium (3) | last seq | last event time | id length | spare
               | id (ID_BYTES)
    rows       per row: key | GPU bitmap | CPU bitmap | DISK bitmap (each `bitmap words` long)

The rows are an open-addressing table with linear probing over `capacity` (a power of two) rows,
keyed by the block's 64-bit hash (keys.py; 0 marks a free row). Bit s of a medium's bitmap says
instance slot s holds the block there, so a lookup costs one probe sequence per prompt block
whatever the fleet's size, and answers for every instance at once.

One writer (the subscriber) and many readers (the workers' request paths). The writer makes every
change between two increments of `seq` (odd while writing); a reader reads `seq`, looks its keys up
and reads `seq` again, and retries when it moved: a seqlock, so readers never block the writer
and never take a lock themselves. A removed block leaves its key with empty bitmaps (a keyed
tombstone, reused when the key comes back or a new key probes past it); when used rows pass
`_MAX_LOAD` of the capacity the writer compacts the table, and past that refuses new blocks.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable
from enum import IntEnum

import numpy as np

from kvgate.kvs_client.events.base import Medium

ID_BYTES = 128
_HEADER_WORDS = 8
_INSTANCE_WORDS = 8 + ID_BYTES // 8
_MEDIA = len(Medium)
# Linear probing stays short below this load; past it the writer compacts, then refuses.
_MAX_LOAD = 0.75
# Rows a reader examines per key and round: longer than almost every cluster at _MAX_LOAD.
_PROBE_WINDOW = 16
_WINDOW_OFFSETS = np.arange(_PROBE_WINDOW)
# A reader that saw the writer move this many times in a row answers "busy" (no events hits).
_READ_ATTEMPTS = 16
# Header words.
_SEQ, _CAPACITY, _WORDS, _SLOTS, _OCCUPIED, _EPOCH = range(6)
# Instance words.
_STATE, _BLOCKS, _LAST_SEQ, _LAST_TS, _ID_LEN, _ID = 0, 1, 4, 5, 6, 8


class FeedState(IntEnum):
    """How much an instance's events tell about its cache (docs/KV_EVENTS.md)."""

    FREE = 0  # slot unused
    SILENT = 1  # no event received since (re)connecting: its cache is unknown
    PARTIAL = 2  # what it reports is true; blocks stored before kvgate listened may be missing
    SYNCED = 3  # every change since its cache was empty has been applied


def layout_words(capacity: int, slots: int) -> tuple[int, int]:
    """(words per row, total words) of an index."""
    row = 1 + _MEDIA * bitmap_words(slots)
    return row, _HEADER_WORDS + slots * _INSTANCE_WORDS + capacity * row


def bitmap_words(slots: int) -> int:
    return (slots + 63) // 64


def capacity_for(max_bytes: int, slots: int) -> int:
    """The largest power-of-two row count whose index fits in `max_bytes`."""
    row = 1 + _MEDIA * bitmap_words(slots)
    fixed = (_HEADER_WORDS + slots * _INSTANCE_WORDS) * 8
    capacity = 1
    while fixed + capacity * 2 * row * 8 <= max_bytes:
        capacity *= 2
    return capacity


class EventsIndex:
    """A view of the index memory. `create` once (writer side), `attach` in each reader process."""

    def __init__(self, buffer: mmap.mmap, path: str | None) -> None:
        self.path = path
        self._map = buffer
        header = np.ndarray((_HEADER_WORDS,), np.uint64, buffer)
        self.capacity = int(header[_CAPACITY])
        self.slots = int(header[_SLOTS])
        self.words = int(header[_WORDS])
        self._row, _ = layout_words(self.capacity, self.slots)
        self._mask = self.capacity - 1
        self._q = memoryview(buffer).cast("Q")  # scalar access: faster than numpy's for one word
        self._instances_at = _HEADER_WORDS
        self._rows_at = _HEADER_WORDS + self.slots * _INSTANCE_WORDS
        self.rows = np.ndarray((self.capacity, self._row), np.uint64, buffer, offset=self._rows_at * 8)
        self.nbytes = len(buffer)
        self._writing = 0

    @classmethod
    def create(cls, max_bytes: int, slots: int, path: str | None = None) -> EventsIndex:
        """A zeroed index of at most `max_bytes`, in the file `path` (shared) or anonymous memory."""
        capacity = capacity_for(max_bytes, slots)
        _, words = layout_words(capacity, slots)
        if path is None:
            buffer = mmap.mmap(-1, words * 8)
        else:
            with open(path, "w+b") as file:
                file.truncate(words * 8)
                buffer = mmap.mmap(file.fileno(), 0)
        header = np.ndarray((_HEADER_WORDS,), np.uint64, buffer)
        header[_CAPACITY], header[_WORDS], header[_SLOTS] = capacity, bitmap_words(slots), slots
        return cls(buffer, path)

    @classmethod
    def attach(cls, path: str) -> EventsIndex:
        with open(path, "r+b") as file:
            return cls(mmap.mmap(file.fileno(), 0), path)

    def close(self) -> None:
        self.rows = None  # type: ignore[assignment]  # numpy views must go before the map closes
        self._q.release()
        self._map.close()

    # --- readers ---

    @property
    def epoch(self) -> int:
        """Moves whenever an instance takes or leaves a slot, or its feed state changes."""
        return self._q[_EPOCH]

    @property
    def occupied(self) -> int:
        return self._q[_OCCUPIED]

    def instance_slots(self) -> dict[str, int]:
        """Instance id -> slot, for slots in use."""
        found = {}
        for slot in range(self.slots):
            at = self._instance(slot)
            if self._q[at + _STATE] != FeedState.FREE:
                length = min(self._q[at + _ID_LEN], ID_BYTES)
                start = (at + _ID) * 8
                found[bytes(self._map[start : start + length]).decode()] = slot
        return found

    def state(self, slot: int) -> FeedState:
        return FeedState(self._q[self._instance(slot) + _STATE])

    def blocks(self, slot: int) -> tuple[int, int, int]:
        """Blocks the slot's instance holds per medium (GPU, CPU, DISK)."""
        at = self._instance(slot) + _BLOCKS
        return self._q[at], self._q[at + 1], self._q[at + 2]

    def last_seq(self, slot: int) -> int:
        return self._q[self._instance(slot) + _LAST_SEQ]

    def lookup(self, keys: np.ndarray) -> np.ndarray | None:
        """The bitmaps of `keys` (uint64), shape (len(keys), media * bitmap words), zeros for keys
        held nowhere; None when the writer kept changing the table (the caller goes without)."""
        seq_word = self._q
        for _ in range(_READ_ATTEMPTS):
            before = seq_word[_SEQ]
            if before % 2 == 0:
                found = self._probe(keys)
                if seq_word[_SEQ] == before:
                    return found
            os.sched_yield()
        return None

    def _probe(self, keys: np.ndarray) -> np.ndarray:
        rows, mask = self.rows, self._mask
        found = np.zeros((len(keys), self._row - 1), np.uint64)
        where = (keys & np.uint64(mask)).astype(np.intp)
        pending = np.arange(len(keys))
        # Each round reads a window of _PROBE_WINDOW rows per key still looking (one gather), so a
        # prompt costs one or two rounds whatever its clusters' lengths. A torn read costs a retry.
        for _ in range(0, self.capacity, _PROBE_WINDOW):
            at = (where[pending, None] + _WINDOW_OFFSETS) & mask
            stored = rows[at, 0]
            match = stored == keys[pending, None]
            ends = match | (stored == 0)  # a key sits before the first free row of its cluster
            first = ends.argmax(axis=1)
            ended = ends[np.arange(len(pending)), first]
            hit = ended & match[np.arange(len(pending)), first]
            if hit.any():
                found[pending[hit]] = rows[at[hit, first[hit]], 1:]
            pending = pending[~ended]
            if not pending.size:
                break
            where[pending] += _PROBE_WINDOW
        return found

    # --- the writer ---

    def begin(self) -> None:
        """Start a change readers must not see half done (nests: the outermost pair counts)."""
        self._writing += 1
        if self._writing == 1:
            self._q[_SEQ] += 1

    def end(self) -> None:
        self._writing -= 1
        if self._writing == 0:
            self._q[_SEQ] += 1

    def take_slot(self, instance_id: str) -> int | None:
        """A free slot for the instance (state SILENT), or None when every slot is taken."""
        encoded = instance_id.encode()[:ID_BYTES]
        for slot in range(self.slots):
            at = self._instance(slot)
            if self._q[at + _STATE] == FeedState.FREE:
                self._map[(at + _ID) * 8 : (at + _ID) * 8 + len(encoded)] = encoded
                self._q[at + _ID_LEN] = len(encoded)
                self._q[at + _LAST_SEQ] = self._q[at + _LAST_TS] = 0
                self._q[at + _STATE] = FeedState.SILENT
                self._q[_EPOCH] += 1
                return slot
        return None

    def free_slot(self, slot: int) -> None:
        self.forget(slot)
        self._q[self._instance(slot) + _STATE] = FeedState.FREE
        self._q[_EPOCH] += 1

    def set_state(self, slot: int, state: FeedState) -> None:
        at = self._instance(slot) + _STATE
        if self._q[at] != state:
            self._q[at] = state
            self._q[_EPOCH] += 1  # readers cache who is unknown until the epoch moves

    def note_seq(self, slot: int, seq: int) -> None:
        self._q[self._instance(slot) + _LAST_SEQ] = seq

    def store(self, slot: int, medium: Medium, keys: Iterable[int], cap: int) -> int:
        """Mark the blocks held by `slot` in `medium`; returns how many could not be (the index is
        full, or the instance holds `cap` blocks over all media). Call between begin() and end()."""
        q, row = self._q, self._row
        word, bit = self._rows_at + 1 + medium * self.words + slot // 64, 1 << (slot % 64)
        counts_at = self._instance(slot) + _BLOCKS
        count_at = counts_at + medium
        held = sum(q[counts_at : counts_at + _MEDIA])  # the cap counts every medium
        refused = 0
        for key in keys:
            at = self._find_or_claim(key)
            if at is None:
                refused += 1
                continue
            flag = at * row + word
            if q[flag] & bit:
                continue
            if held >= cap:
                refused += 1
                continue
            q[flag] |= bit
            q[count_at] += 1
            held += 1
        return refused

    def remove(self, slot: int, medium: Medium, keys: Iterable[int]) -> None:
        """Call between begin() and end()."""
        q, row = self._q, self._row
        word, bit = self._rows_at + 1 + medium * self.words + slot // 64, 1 << (slot % 64)
        count_at = self._instance(slot) + _BLOCKS + medium
        for key in keys:
            at = self._find(key)
            if at is not None and q[at * row + word] & bit:
                q[at * row + word] &= ~bit & 0xFFFF_FFFF_FFFF_FFFF
                q[count_at] -= 1

    def holds(self, slot: int, key: int) -> bool:
        """Whether the slot holds the block in any medium (the writer's own read)."""
        at = self._find(key)
        if at is None:
            return False
        first = at * self._row + self._rows_at + 1 + slot // 64
        return any(self._q[first + medium * self.words] & (1 << (slot % 64)) for medium in range(_MEDIA))

    def forget(self, slot: int) -> None:
        """Everything the slot held leaves the index (its rows stay as tombstones)."""
        self.begin()
        try:
            column = slot // 64
            keep = ~np.uint64(1 << (slot % 64))
            for medium in range(_MEDIA):
                self.rows[:, 1 + medium * self.words + column] &= keep
            at = self._instance(slot) + _BLOCKS
            for medium in range(_MEDIA):
                self._q[at + medium] = 0
        finally:
            self.end()

    def compact(self) -> None:
        """Rebuild the table without its tombstones (between begin() and end())."""
        live = self.rows[self.rows[:, 1:].any(axis=1)].copy()
        self.rows[:] = 0
        where = (live[:, 0] & np.uint64(self._mask)).astype(np.intp)
        pending = np.arange(len(live))
        while pending.size:
            at = where[pending]
            free = self.rows[at, 0] == 0
            # Among keys aiming at the same free row this round, the first takes it.
            candidates = pending[free]
            _, first = np.unique(at[free], return_index=True)
            placed = candidates[first]
            self.rows[where[placed]] = live[placed]
            pending = np.setdiff1d(pending, placed, assume_unique=True)
            where[pending] = (where[pending] + 1) & self._mask
        self._q[_OCCUPIED] = len(live)

    def _find(self, key: int) -> int | None:
        q, row, mask = self._q, self._row, self._mask
        at = key & mask
        for _ in range(self.capacity):
            stored = q[self._rows_at + at * row]
            if stored == key:
                return at
            if stored == 0:
                return None
            at = (at + 1) & mask
        return None

    def _find_or_claim(self, key: int) -> int | None:
        """The row of `key`, claiming a free row or a tombstone for it if it has none; None when full."""
        q, row, mask, base = self._q, self._row, self._mask, self._rows_at
        at = key & mask
        tombstone = None
        for _ in range(self.capacity):
            start = base + at * row
            stored = q[start]
            if stored == key:
                return at
            if stored == 0:
                break
            if tombstone is None and not any(q[start + 1 : start + row]):
                tombstone = at
            at = (at + 1) & mask
        else:
            at = None  # type: ignore[assignment]  # every row probed: full of other keys
        if tombstone is not None:
            q[base + tombstone * row] = key
            return tombstone
        if at is None or q[_OCCUPIED] + 1 > _MAX_LOAD * self.capacity:
            self.compact()
            if q[_OCCUPIED] + 1 > _MAX_LOAD * self.capacity:
                return None
            return self._find_or_claim(key)
        q[base + at * row] = key
        q[_OCCUPIED] += 1
        return at

    def _instance(self, slot: int) -> int:
        return self._instances_at + slot * _INSTANCE_WORDS
