"""A mock engine's cache changes (block keys in, block keys out) as the KV events vLLM would send.

The engine core knows blocks only by the gateway's store keys. vLLM's events name a block by
vLLM's own hash, its parent's hash and its tokens, so each request's prompt blocks are described
here before the request enters the engine (`hold`) and forgotten once no request needs them and
the cache no longer holds them. Every block the cache holds was held by the request that computed
it, so every change can be told.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.mock_engine.kv_event_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    HashFormat,
    KVEvent,
    wire_hash,
)

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Block:
    digest: bytes
    parent: bytes | None
    token_ids: Sequence[int]
    holders: int = 0  # requests in the engine whose prompt has this block
    cached: bool = False


class BlockEventTranslator:
    def __init__(self, block_size: int, hash_format: HashFormat) -> None:
        self._block_size = block_size
        self._hash_format = hash_format
        self._blocks: dict[str, _Block] = {}

    def __len__(self) -> int:
        return len(self._blocks)

    def hold(self, keys: Sequence[str], digests: Sequence[bytes], token_ids: Sequence[int]) -> None:
        """A request's full prompt blocks (store keys and vLLM digests, in order) before it is submitted."""
        if len(keys) != len(digests):
            raise ValueError(f"{len(keys)} block keys but {len(digests)} vLLM block hashes")
        size = self._block_size
        parent = None
        for i, (key, digest) in enumerate(zip(keys, digests, strict=True)):
            block = self._blocks.get(key)
            if block is None:
                block = self._blocks[key] = _Block(digest, parent, token_ids[i * size : (i + 1) * size])
            block.holders += 1
            parent = digest

    def release(self, keys: Sequence[str]) -> None:
        """The request that held these keys left the engine."""
        blocks = self._blocks
        for key in keys:
            block = blocks[key]
            block.holders -= 1
            if not block.holders and not block.cached:
                del blocks[key]

    def changes(self, added: Sequence[str], evicted: Sequence[str]) -> list[KVEvent]:
        """One engine step's cache changes as vLLM orders them: evictions (made while admitting),
        then the blocks computed, one BlockStored per run of chained blocks."""
        events: list[KVEvent] = []
        blocks = self._blocks
        for key in evicted:
            block = blocks.get(key)
            if block is None:
                logger.warning("KV events: evicted block %s was never described; not reported", key)
                continue
            # vLLM reports each evicted block in an event of its own.
            events.append(BlockRemoved([wire_hash(block.digest, self._hash_format)]))
            block.cached = False
            if not block.holders:
                del blocks[key]
        run: list[_Block] = []
        for key in added:
            block = blocks.get(key)
            if block is None:
                logger.warning("KV events: stored block %s was never described; not reported", key)
                continue
            block.cached = True
            if run and block.parent != run[-1].digest:
                events.append(self._stored(run))
                run = []
            run.append(block)
        if run:
            events.append(self._stored(run))
        return events

    def cleared(self) -> list[KVEvent]:
        """The whole prefix cache was dropped (a cache reset)."""
        for key in [key for key, block in self._blocks.items() if block.cached and not block.holders]:
            del self._blocks[key]
        for block in self._blocks.values():
            block.cached = False
        return [AllBlocksCleared()]

    def _stored(self, run: list[_Block]) -> BlockStored:
        fmt = self._hash_format
        parent = run[0].parent
        return BlockStored(
            block_hashes=[wire_hash(block.digest, fmt) for block in run],
            parent_block_hash=None if parent is None else wire_hash(parent, fmt),
            token_ids=[token for block in run for token in block.token_ids],
            block_size=self._block_size,
        )
