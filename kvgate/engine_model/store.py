"""The shared KV store of a simulated fleet: one DRAM segment per instance, one pool for all.

As in a Mooncake deployment, each instance's segment keeps the blocks that instance computed
(least recently used evicted first, per segment; a block another segment already holds is not
stored twice), and any instance can load a block from any segment: from its own at host-link
bandwidth, from another's over the network. The HBM prefix cache stays per instance (the
engine's BlockCache); the store is what lies behind it.

A block that stays hot in some instance's HBM is never loaded from the store, so the store can
evict it while it is in use. The instance's connector then writes it back the next time a request
uses it (`restore`: it checks existence before a put, as LMCache's store path does), so the pool -
and the index the gateway reads - does not lose a prefix every instance still serves. Without it
the trace's first block, shared by every request, left the index after a few minutes and the
gateway saw no prefix anywhere for the rest of the replay.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StoreProfile:
    kv_bytes_per_token: int = 131072  # Llama-3-8B shape, bf16
    host_bytes_per_s: float = 50e9  # PCIe 5.0 x16, effective
    network_bytes_per_s: float = 25e9  # one 200 Gb/s RDMA NIC


@dataclass(frozen=True, slots=True)
class StoreLoad:
    """A prefix an instance can load instead of computing: leading blocks from its own segment or
    others', and the seconds the copy takes."""

    own_blocks: int
    remote_blocks: int
    seconds: float

    @property
    def blocks(self) -> int:
        return self.own_blocks + self.remote_blocks


class SharedStore:
    def __init__(self, num_segments: int, segment_blocks: int, block_tokens: int, profile: StoreProfile) -> None:
        if segment_blocks < 1:
            raise ValueError("segment_blocks must be >= 1")
        self._segments: list[OrderedDict[str, None]] = [OrderedDict() for _ in range(num_segments)]
        self._holder: dict[str, int] = {}  # key -> the segment holding it (one replica)
        self._capacity = segment_blocks
        self._block_bytes = block_tokens * profile.kv_bytes_per_token
        self._profile = profile

    def holder(self, key: str) -> int | None:
        return self._holder.get(key)

    def plan_load(self, segment: int, keys: Sequence[str], touch: bool = True) -> StoreLoad:
        """How many of `keys` (the blocks after the HBM hit), from the first, the pool holds; touches
        them unless `touch` is False (a what-if forecast)."""
        own = remote = 0
        for key in keys:
            holder = self._holder.get(key)
            if holder is None:
                break
            if touch:
                self._segments[holder].move_to_end(key)
            if holder == segment:
                own += 1
            else:
                remote += 1
        p = self._profile
        seconds = self._block_bytes * (own / p.host_bytes_per_s + remote / p.network_bytes_per_s)
        return StoreLoad(own, remote, seconds)

    def store(self, segment: int, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """Keep computed blocks in the segment; returns (keys added, keys evicted) for the index."""
        added: list[str] = []
        evicted: list[str] = []
        for key in keys:
            holder = self._holder.get(key)
            if holder is not None:
                self._segments[holder].move_to_end(key)  # a second put adds no replica
                continue
            self._put(segment, key, added, evicted)
        return added, evicted

    def restore(self, segment: int, keys: Sequence[str]) -> tuple[list[str], list[str]]:
        """Write back blocks an instance holds in HBM that the pool no longer holds; held ones are
        left untouched (their recency is the store's own). Returns (keys added, keys evicted)."""
        added: list[str] = []
        evicted: list[str] = []
        for key in keys:
            if key not in self._holder:
                self._put(segment, key, added, evicted)
        return added, evicted

    def _put(self, segment: int, key: str, added: list[str], evicted: list[str]) -> None:
        lru = self._segments[segment]
        if len(lru) >= self._capacity:
            old, _ = lru.popitem(last=False)
            del self._holder[old]
            evicted.append(old)
        lru[key] = None
        self._holder[key] = segment
        added.append(key)
