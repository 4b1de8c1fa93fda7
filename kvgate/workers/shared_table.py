"""The memory every worker of one gateway shares: the instance table, the account rows, engine stats.

One memory-mapped file (in a tmpfs, /dev/shm, when there is one), laid out as 8-byte words (int64, or float64 where noted):

    header   epoch | capacity | writers | next generation
    slots    per instance slot: generation | flags | config length | config JSON (CONFIG_BYTES)
    counts   per slot, per writer row: generation | requests | awaiting first token | prefill tokens
    engine   per slot: generation | seen at (float) | running | waiting | kv usage (float)

A slot index is an instance's row index in every worker. Its generation is unique for the life of
the block, so a row or engine report written for an instance that was removed (and whose slot was
reused) never counts for the next one: readers only add values stamped with the slot's current
generation. Counts rows have a single writer each (a worker; the last row is the leader's copy of
the other replicas' sums), so the request path takes no lock. Table changes (admin routes, health
transitions) are rare: they take a file lock (released by the kernel if its holder dies) and move
`epoch` to odd while writing and to even after, so a reader retries a table it saw half-written.

A writer killed inside a change leaves the epoch odd, and readers would retry until they give up.
Each change's last word store is its commit (a slot's USED flag, its flags word), so whatever prefix
of it was written is a table as it was before or after; `recover` (the supervisor's, once the
writer is dead and the lock free) only moves the epoch back to even.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass

from kvgate.config.settings import InstanceConfig
from kvgate.scheduler.account import ZERO, Counts
from kvgate.scheduler.types import EngineStats

CONFIG_BYTES = 2048
_WORD = 8
_HEADER_WORDS = 4
_SLOT_WORDS = 3 + CONFIG_BYTES // _WORD
_COUNT_WORDS = 4
_ENGINE_WORDS = 5
_ENGINE = struct.Struct("qdqqd")
_READ_TIMEOUT_S = 5.0
# Slot flags. DISCOVERED marks an instance discovery added: it outlives the leader worker that added it,
# and the restarted leader takes it up again (kvgate/discovery/reconciler.py).
USED, DRAINING, EJECTED, DISCOVERED = 1, 2, 4, 8


def map_words(path: str) -> tuple[mmap.mmap, memoryview, memoryview]:
    """The file mapped, and two views of its 8-byte words: as int64 and as float64."""
    with open(path, "r+b") as file:
        mapped = mmap.mmap(file.fileno(), 0)
    return mapped, memoryview(mapped).cast("q"), memoryview(mapped).cast("d")


class TableFull(RuntimeError):
    """No free slot for another instance (raise --workers-max-instances)."""


@dataclass(frozen=True, slots=True)
class SlotEntry:
    slot: int
    generation: int
    flags: int
    config: InstanceConfig


class SharedTable:
    """A view of the shared block; `create` in the supervisor, `attach` in each worker."""

    def __init__(self, path: str, lock_path: str) -> None:
        self.path = path
        self._lock_path = lock_path
        self._map, self._q, self._d = map_words(path)
        self.capacity = self._q[1]
        self.writers = self._q[2]
        self._slots_at = _HEADER_WORDS
        self._counts_at = self._slots_at + self.capacity * _SLOT_WORDS
        self._engine_at = self._counts_at + self.capacity * self.writers * _COUNT_WORDS
        # One unpack per read on the request path: a memoryview index per word costs 3x more.
        self._slot_counts = struct.Struct(f"{self.writers * _COUNT_WORDS}q")
        # Parsed configurations by generation: a health transition re-reads the table, not the JSON.
        self._configs: dict[int, InstanceConfig] = {}
        # instance id -> (slot, generation), rebuilt when the epoch moves.
        self._index: dict[str, tuple[int, int]] = {}
        self._index_epoch = -1

    @classmethod
    def create(cls, path: str, capacity: int, writers: int, lock_path: str) -> SharedTable:
        words = _HEADER_WORDS + capacity * (_SLOT_WORDS + writers * _COUNT_WORDS + _ENGINE_WORDS)
        with open(path, "wb") as file:
            # epoch 0, the sizes, and generations counted from 1 (0 stamps nothing); the rest zeros.
            file.write(struct.pack("4q", 0, capacity, writers, 1))
            file.truncate(words * _WORD)
        open(lock_path, "a").close()
        return cls(path, lock_path)

    @classmethod
    def attach(cls, path: str, lock_path: str) -> SharedTable:
        return cls(path, lock_path)

    def close(self) -> None:
        """Unmap (the supervisor removes the file with its run directory)."""
        self._q.release()
        self._d.release()
        self._map.close()

    # --- the instance table ---

    @property
    def epoch(self) -> int:
        return self._q[0]

    def entries(self) -> tuple[int, list[SlotEntry]]:
        """(epoch, used slots in the order they were filled): a consistent snapshot."""
        # A writer holds the odd epoch for microseconds, unless it is descheduled meanwhile.
        deadline = time.monotonic() + _READ_TIMEOUT_S
        while time.monotonic() < deadline:
            before = self._q[0]
            if before % 2 == 0:
                parsed: dict[int, InstanceConfig] = {}
                try:
                    found = [self._read_slot(slot, parsed) for slot in range(self.capacity)
                             if self._q[self._slot(slot) + 1] & USED]
                except ValueError:  # a slot read while being rewritten: its JSON is torn
                    found = None
                if found is not None and self._q[0] == before:
                    self._remember(parsed)
                    found.sort(key=lambda entry: entry.generation)
                    return before, found
            os.sched_yield()
        raise RuntimeError("the shared instance table kept changing while being read")

    def lookup(self, instance_id: str) -> tuple[int, int] | None:
        """(slot, generation) of an instance, or None when it is not in the table."""
        if self._q[0] != self._index_epoch:
            epoch, found = self.entries()
            self._index = {entry.config.id: (entry.slot, entry.generation) for entry in found}
            self._index_epoch = epoch
        return self._index.get(instance_id)

    @contextlib.contextmanager
    def changing(self) -> Iterator[None]:
        """Hold the table's write lock (the kernel drops it if the holder dies)."""
        with open(self._lock_path, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        # Odd epoch while a slot is half-written: readers retry.
        self._q[0] += 1
        try:
            yield
        finally:
            self._q[0] += 1

    def recover(self) -> bool:
        """End a change its writer died inside (call inside `changing`); True if there was one."""
        if self._q[0] % 2 == 0:
            return False
        self._q[0] += 1
        return True

    def find(self, instance_id: str) -> SlotEntry | None:
        """The slot holding `instance_id` (call inside `changing`: no writer can interfere)."""
        for slot in range(self.capacity):
            if self._q[self._slot(slot) + 1] & USED:
                entry = self._read_slot(slot)
                if entry.config.id == instance_id:
                    return entry
        return None

    def add(self, config: InstanceConfig, flags: int = 0) -> None:
        """Put an instance in a free slot with `flags` (call inside `changing`)."""
        data = config.model_dump_json().encode()
        if len(data) > CONFIG_BYTES:
            raise ValueError(f"instance {config.id!r}: its configuration exceeds {CONFIG_BYTES} bytes")
        free = next((s for s in range(self.capacity) if not self._q[self._slot(s) + 1] & USED), None)
        if free is None:
            raise TableFull(f"the gateway holds {self.capacity} instances already (--workers-max-instances)")
        base = self._slot(free)
        with self._writing():
            generation = self._q[3]
            self._q[3] = generation + 1
            start = (base + 3) * _WORD
            self._map[start : start + len(data)] = data
            self._q[base + 2] = len(data)
            self._q[base] = generation
            self._q[base + 1] = USED | flags

    def set_flags(self, slot: int, flags: int) -> None:
        """Replace an instance's flags (call inside `changing`); USED is kept."""
        with self._writing():
            self._q[self._slot(slot) + 1] = USED | flags

    def remove(self, slot: int) -> None:
        """Free a slot (call inside `changing`); its rows stop counting with the generation gone."""
        with self._writing():
            self._q[self._slot(slot) + 1] = 0

    def _slot(self, slot: int) -> int:
        return self._slots_at + slot * _SLOT_WORDS

    def _read_slot(self, slot: int, parsed: dict[int, InstanceConfig] | None = None) -> SlotEntry:
        """The slot's entry; a configuration not parsed before goes to `parsed`, which the caller
        remembers only once it knows the read was not torn."""
        base = self._slot(slot)
        generation = self._q[base]
        config = self._configs.get(generation)
        if config is None:
            start = (base + 3) * _WORD
            config = InstanceConfig.model_validate_json(self._map[start : start + self._q[base + 2]])
            if parsed is not None:
                parsed[generation] = config
        return SlotEntry(slot, generation, self._q[base + 1], config)

    def _remember(self, parsed: dict[int, InstanceConfig]) -> None:
        if len(self._configs) + len(parsed) > 2 * self.capacity:  # removed instances' entries
            self._configs.clear()
        self._configs.update(parsed)

    # --- account rows ---

    def write_counts(self, writer: int, slot: int, generation: int, counts: Counts) -> None:
        q, at = self._q, self._counts_at + (slot * self.writers + writer) * _COUNT_WORDS
        # Counts first, stamp last: a reader never adds a fresh stamp to another instance's counts.
        q[at + 1], q[at + 2], q[at + 3] = counts
        q[at] = generation

    def summed_counts(self, slot: int, generation: int, writers: range | None = None) -> Counts:
        words = self._slot_counts.unpack_from(self._map, (self._counts_at + slot * self.writers * _COUNT_WORDS) * _WORD)
        requests = awaiting = tokens = 0
        for writer in writers if writers is not None else range(self.writers):
            at = writer * _COUNT_WORDS
            if words[at] == generation:
                requests += words[at + 1]
                awaiting += words[at + 2]
                tokens += words[at + 3]
        return requests, awaiting, tokens

    def clear_writer(self, writer: int) -> None:
        """A dead writer's rows leave the account (the supervisor calls this before restarting it)."""
        for slot in range(self.capacity):
            self.write_counts(writer, slot, 0, ZERO)

    # --- engine reports ---

    def write_engine(self, slot: int, generation: int, stats: EngineStats, seen: float) -> None:
        q, d, at = self._q, self._d, self._engine_at + slot * _ENGINE_WORDS
        q[at] = 0  # invalid while being written
        d[at + 1] = seen
        q[at + 2], q[at + 3] = stats.num_running, stats.num_waiting
        d[at + 4] = stats.kv_cache_usage_ratio
        q[at] = generation

    def read_engine(self, slot: int, generation: int) -> tuple[EngineStats, float] | None:
        stamp, seen, running, waiting, usage = _ENGINE.unpack_from(self._map, (self._engine_at + slot * _ENGINE_WORDS) * _WORD)
        if stamp != generation:
            return None
        return EngineStats(running, waiting, usage), seen

    def forget_engine(self, slot: int) -> None:
        self._q[self._engine_at + slot * _ENGINE_WORDS] = 0

