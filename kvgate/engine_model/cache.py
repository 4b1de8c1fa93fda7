"""An engine's prefix cache: fixed-size KV blocks named by block keys, evicted least recently used.

Blocks in use by a running request are *pinned* and never evicted. Memory a running request will
still need (blocks it has not computed yet, its partial last block, its decode tokens) is
*reserved*: it counts against capacity without a key. So at every moment
`pinned + evictable + reserved <= capacity`, and a request is admitted only if its reservation fits
after evicting unpinned blocks (as vLLM admits only when free blocks suffice).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence


class BlockCache:
    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError("capacity_blocks must be >= 1")
        self.capacity_blocks = capacity_blocks
        # Evictable blocks, least recently used first.
        self._lru: OrderedDict[str, None] = OrderedDict()
        # Pinned blocks -> number of running requests using them (not in _lru).
        self._pins: dict[str, int] = {}
        self._reserved = 0

    def __len__(self) -> int:
        return len(self._lru) + len(self._pins)

    def __contains__(self, key: object) -> bool:
        return key in self._pins or key in self._lru

    def keys(self) -> list[str]:
        """Every cached key: pinned ones, then evictable ones from least to most recently used."""
        return [*self._pins, *self._lru]

    @property
    def used_blocks(self) -> int:
        """Blocks held for running requests (pinned or reserved): what vLLM reports as KV usage."""
        return len(self._pins) + self._reserved

    @property
    def free_blocks(self) -> int:
        return self.capacity_blocks - len(self._lru) - len(self._pins) - self._reserved

    def copy(self) -> BlockCache:
        """An independent cache in the same state (for what-if forecasts)."""
        clone = BlockCache(self.capacity_blocks)
        clone._lru = self._lru.copy()
        clone._pins = dict(self._pins)
        clone._reserved = self._reserved
        return clone

    def clear(self) -> list[str] | None:
        """Drop every cached block (a prefix-cache reset); returns their keys, or None (and changes
        nothing) while running requests hold blocks or reserved room, as vLLM refuses then."""
        if self._pins or self._reserved:
            return None
        dropped = list(self._lru)
        self._lru.clear()
        return dropped

    def match_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys are cached (contiguous from the first); those are touched."""
        lru, pins = self._lru, self._pins
        matched = 0
        for key in keys:
            if key in lru:
                lru.move_to_end(key)
            elif key not in pins:
                break
            matched += 1
        return matched

    def insert(self, keys: Iterable[str]) -> list[str]:
        """Cache keys as most recently used and unpinned; returns the keys evicted to make room.

        A key that cannot get room (everything else pinned or reserved) is not cached.
        """
        evicted: list[str] = []
        for key in keys:
            if key in self._pins:
                continue
            if key in self._lru:
                self._lru.move_to_end(key)
                continue
            if self.free_blocks <= 0:
                if not self._lru:
                    continue
                evicted.append(self._lru.popitem(last=False)[0])
            self._lru[key] = None
        return evicted

    def pin(self, keys: Iterable[str]) -> None:
        """Protect cached keys from eviction while a request uses them."""
        for key in keys:
            if key in self._lru:
                del self._lru[key]
                self._pins[key] = 1
            else:
                self._pins[key] += 1

    def unpin(self, keys: Iterable[str]) -> None:
        """Release a request's use; blocks nobody uses become evictable (most recently used)."""
        pins = self._pins
        for key in keys:
            count = pins[key] - 1
            if count:
                pins[key] = count
            else:
                del pins[key]
                self._lru[key] = None

    def reserve(self, num_blocks: int) -> list[str] | None:
        """Set aside room for num_blocks, evicting LRU blocks as needed.

        Returns the evicted keys, or None (and changes nothing) if they cannot fit.
        """
        shortfall = num_blocks - self.free_blocks
        if shortfall > len(self._lru):
            return None
        evicted = [self._lru.popitem(last=False)[0] for _ in range(max(0, shortfall))]
        self._reserved += num_blocks
        return evicted

    def release(self, num_blocks: int) -> None:
        """Give back reserved room that will not be used."""
        if num_blocks > self._reserved:
            raise ValueError(f"releasing {num_blocks} blocks but only {self._reserved} reserved")
        self._reserved -= num_blocks

    def commit(self, keys: Sequence[str]) -> list[str]:
        """Turn reserved room into these computed blocks, pinned; returns the keys newly cached.

        A key already cached (another request computed the same block meanwhile) is pinned again
        and its reserved slot freed.
        """
        self.release(len(keys))
        added = []
        pins, lru = self._pins, self._lru
        for key in keys:
            if key in pins:
                pins[key] += 1
            elif key in lru:
                del lru[key]
                pins[key] = 1
            else:
                pins[key] = 1
                added.append(key)
        return added
