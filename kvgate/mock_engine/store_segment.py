"""A mock engine's own DRAM segment of a KV store, behind its HBM prefix cache.

As with a Mooncake segment or LMCache's CPU backend on the engine's host: the blocks the engine
computes are written to its segment (least recently used evicted first), a prompt's blocks that
left HBM but stay in the segment are loaded back at host-link bandwidth instead of computed, and
the store index the gateway reads lists the segment's blocks, not HBM's. So with a segment larger
than HBM the store knows more than the engine's KV events (HBM only) tell: the two views differ as
in production. The segment and its loads are engine_model.store's SharedStore, with one segment.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvgate.engine_model.store import SharedStore, StoreLoad, StoreProfile

IndexChange = Callable[[list[str], list[str]], None]  # (keys the segment added, keys it evicted)


class StoreSegment:
    def __init__(self, blocks: int, block_tokens: int, profile: StoreProfile, on_index_change: IndexChange | None,
                 on_loaded: Callable[[list[str]], None] | None = None) -> None:
        self._store = SharedStore(1, blocks, block_tokens, profile)
        self._on_index_change = on_index_change
        self._on_loaded = on_loaded  # keys loaded into HBM (stored blocks, to the engine's KV events)

    def computed(self, keys: Sequence[str]) -> None:
        """Blocks the engine computed go to the segment as well."""
        self._index(*self._store.store(0, keys))

    def load(self, keys: tuple[str, ...]) -> StoreLoad:
        """The engine core's loader: the leading `keys` (after the HBM hit) the segment holds."""
        plan = self._store.plan_load(0, keys)
        if plan.blocks and self._on_loaded is not None:
            self._on_loaded(list(keys[: plan.blocks]))
        return plan

    def write_back(self, keys: tuple[str, ...]) -> None:
        """The engine core's writer: HBM hits the segment evicted meanwhile are put back."""
        self._index(*self._store.restore(0, keys))

    def _index(self, added: list[str], evicted: list[str]) -> None:
        if self._on_index_change is not None and (added or evicted):
            self._on_index_change(added, evicted)
