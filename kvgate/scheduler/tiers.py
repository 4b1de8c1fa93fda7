"""Where the pool holds a request's blocks, priced per instance: the tiered view of a store answer.

A Mooncake store is one pool: a block in any instance's DRAM segment or on disk can be loaded by
every instance over the transfer engine, at a cost that depends on where it lies. For each
instance this gives two prefixes (both contiguous from block 0, capped at the prompt):

- local: what the instance holds in its own segment (Llumnix's prefix hit, `prefix_hit_tokens`);
- pool: what is held anywhere, memory or (with `--kvs-query-disk-tier`) disk, block by block in
  the cheapest tier this instance could load it from: its own segment (free), another segment's
  DRAM (network), a disk tier (disk).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import IntEnum

from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.prefix import EndpointMap, prefix_hit_tokens


class Tier(IntEnum):
    """Cheapest first."""

    LOCAL = 0  # the instance's own segment (its prefix cache)
    NETWORK = 1  # another segment's DRAM, over the transfer engine
    DISK = 2  # a local SSD, NVMe-oF or shared storage


@dataclass(frozen=True, slots=True)
class _PoolBlock:
    tokens: int
    tier: Tier  # cheapest tier for an instance that does not hold it itself
    holders: frozenset[str]  # instances holding it in their own segment


class TieredHits:
    """Per-instance local and pool prefixes of one request (pure, built from a store answer)."""

    __slots__ = ("local", "pool_tokens", "_blocks", "_network_cum", "_disk_cum", "_starts", "_any_holder")

    def __init__(self, local: dict[str, int], blocks: list[_PoolBlock]) -> None:
        self.local = local
        self._blocks = blocks
        self.pool_tokens = sum(block.tokens for block in blocks)
        self._any_holder = frozenset().union(*(block.holders for block in blocks))
        network = disk = 0
        self._network_cum, self._disk_cum, self._starts = [0], [0], [0]
        for block in blocks:
            network += block.tokens if block.tier == Tier.NETWORK else 0
            disk += block.tokens if block.tier == Tier.DISK else 0
            self._network_cum.append(network)
            self._disk_cum.append(disk)
            self._starts.append(self._starts[-1] + block.tokens)

    @classmethod
    def empty(cls) -> TieredHits:
        return cls({}, [])

    def transfer_tokens(self, instance_id: str) -> tuple[int, int]:
        """(network, disk) tokens the instance would load to extend its local prefix to the pool's."""
        local = self.local.get(instance_id, 0)
        if local >= self.pool_tokens:
            return 0, 0
        first = _block_at(self._starts, local)
        if instance_id not in self._any_holder:
            # The common case: nothing of its own in the pool prefix, so the prefix sums answer.
            return self._network_cum[-1] - self._network_cum[first], self._disk_cum[-1] - self._disk_cum[first]
        network = disk = 0
        for block in self._blocks[first:]:
            if instance_id in block.holders:
                continue
            if block.tier == Tier.NETWORK:
                network += block.tokens
            else:
                disk += block.tokens
        return network, disk


def _block_at(starts: list[int], tokens: int) -> int:
    """Index of the block where a prefix of `tokens` ends (local prefixes end on block bounds)."""
    for index, start in enumerate(starts):
        if start >= tokens:
            return index
    return len(starts) - 1


def tiered_hits(
    blocks: Sequence[BlockHash],
    memory: Sequence[Collection[str]],
    disk: Sequence[Collection[str]] | None,
    endpoint_map: EndpointMap,
    num_prompt_tokens: int,
) -> TieredHits:
    """`memory[i]` / `disk[i]`: endpoints holding block i in DRAM / on a disk tier (None: not asked)."""
    local = prefix_hit_tokens(blocks, memory, endpoint_map, num_prompt_tokens)
    resolve = endpoint_map.resolved.__getitem__
    pool: list[_PoolBlock] = []
    covered = 0
    for i, (block, endpoints) in enumerate(zip(blocks, memory, strict=False)):
        if covered >= num_prompt_tokens:
            break
        on_disk = bool(disk[i]) if disk is not None and i < len(disk) else False
        if not endpoints and not on_disk:
            break
        tokens = min(block.num_tokens, num_prompt_tokens - covered)
        holders = frozenset().union(*map(resolve, endpoints)) if endpoints else frozenset()
        pool.append(_PoolBlock(tokens, Tier.NETWORK if endpoints else Tier.DISK, holders))
        covered += tokens
    return TieredHits(local, pool)
