"""Where the pool holds a request's blocks, priced per instance: the tiered view of a store answer.

A Mooncake store is one pool: a block in any instance's DRAM segment or on disk can be loaded by
every instance over the transfer engine, at a cost that depends on where it lies. For each
instance this gives two prefixes (both contiguous from block 0, capped at the prompt):

- local: what the instance holds in its own segment (Llumnix's prefix hit, `prefix_hit_tokens`);
- pool: what is held anywhere, memory or (with `--kvs-query-disk-tier`) disk, block by block in
  the cheapest tier this instance could load it from: its own segment (free), another segment's
  DRAM (network), a disk tier (disk).

The engines' KV events (docs/KV_EVENTS.md) add a third view, `EngineHits`: the prefix each engine
holds itself, in its GPU prefix cache (free), its CPU offload tier (host link) or its storage tier
(disk). No other instance can load those blocks, so they extend the holder's local prefix alone: an
instance's local prefix is the longer of its own segment's and its engine's.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from itertools import groupby
from operator import or_

from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.prefix import EndpointMap, prefix_hit_tokens


class Tier(IntEnum):
    """Cheapest first."""

    LOCAL = 0  # the instance's own segment (its prefix cache)
    NETWORK = 1  # another segment's DRAM, over the transfer engine
    DISK = 2  # a local SSD, NVMe-oF or shared storage


@dataclass(frozen=True, slots=True)
class EnginePrefix:
    """The prefix (contiguous from block 0) an instance's engine holds, split by where each block is
    cheapest to reuse."""

    gpu_tokens: int
    cpu_tokens: int = 0
    disk_tokens: int = 0

    @property
    def tokens(self) -> int:
        return self.gpu_tokens + self.cpu_tokens + self.disk_tokens


@dataclass(frozen=True, slots=True)
class EngineHits:
    """What the engines' KV events say about one prompt. An instance absent from `prefixes` holds
    none of it, unless it is in `unknown`: an engine that has published nothing since kvgate
    listened, whose cache kvgate cannot see (it is routed as holding nothing, and shown as unknown)."""

    prefixes: Mapping[str, EnginePrefix] = field(default_factory=dict)
    unknown: frozenset[str] = frozenset()


def local_hit_tokens(
    store_local: Mapping[str, int], engine: EngineHits | None, num_prompt_tokens: int
) -> dict[str, int]:
    """Each instance's local prefix: the longer of its own store segment's and its engine's."""
    if engine is None or not engine.prefixes:
        return dict(store_local)
    local = dict(store_local)
    for instance_id, prefix in engine.prefixes.items():
        tokens = min(prefix.tokens, num_prompt_tokens)
        if tokens > local.get(instance_id, 0):
            local[instance_id] = tokens
    return local


class TieredHits:
    """Per-instance local and pool prefixes of one request (pure, built from a store answer and
    the engines' events).

    The pool prefix is kept as runs of consecutive blocks with the same holders and tier: a
    prompt's blocks usually sit on a few segments, so pricing an instance walks a few runs.
    """

    __slots__ = ("local", "engine", "pool_tokens", "_runs", "_any_holder")

    def __init__(self, local: dict[str, int], runs: list[_Run], engine: EngineHits | None = None) -> None:
        self.local = local
        self.engine: Mapping[str, EnginePrefix] = engine.prefixes if engine is not None else {}
        self._runs = runs
        self.pool_tokens = sum(run.tokens for run in runs)
        self._any_holder = frozenset().union(*(run.holders for run in runs))

    @classmethod
    def empty(cls) -> TieredHits:
        return cls({}, [])

    def own_tier_tokens(self, instance_id: str) -> tuple[int, int]:
        """(host, disk) tokens of the local prefix the instance loads from its own engine's CPU or
        storage tier (none when its store segment's prefix is at least as long)."""
        prefix = self.engine.get(instance_id)
        if prefix is None or prefix.tokens < self.local.get(instance_id, 0):
            return 0, 0
        return prefix.cpu_tokens, prefix.disk_tokens

    def transfer_tokens(self, instance_id: str) -> tuple[int, int]:
        """(network, disk) tokens the instance would load to extend its local prefix to the pool's."""
        local = self.local.get(instance_id, 0)
        if local >= self.pool_tokens:
            return 0, 0
        holds_some = instance_id in self._any_holder
        network = disk = 0
        start = 0
        for run in self._runs:
            end = start + run.tokens
            beyond_local = end - max(start, local)
            start = end
            if beyond_local <= 0 or (holds_some and instance_id in run.holders):
                continue  # its own segment's blocks are its prefix cache: free
            if run.tier == Tier.NETWORK:
                network += beyond_local
            else:
                disk += beyond_local
        return network, disk


class _Run:
    __slots__ = ("tokens", "tier", "holders")

    def __init__(self, tokens: int, tier: Tier, holders: frozenset[str]) -> None:
        self.tokens = tokens
        self.tier = tier  # cheapest tier for an instance that does not hold it itself
        self.holders = holders  # instances holding these blocks in their own segment


def tiered_hits(
    blocks: Sequence[BlockHash],
    memory: Sequence[Collection[str]],
    disk: Sequence[Collection[str]] | None,
    endpoint_map: EndpointMap,
    num_prompt_tokens: int,
    local: dict[str, int] | None = None,
    engine: EngineHits | None = None,
) -> TieredHits:
    """`memory[i]` / `disk[i]`: endpoints holding block i in DRAM / on a disk tier (None: not asked).
    `local`: the local prefixes (prefix_hit_tokens, merged with `engine`'s) if already computed."""
    if local is None:
        local = local_hit_tokens(prefix_hit_tokens(blocks, memory, endpoint_map, num_prompt_tokens), engine,
                                 num_prompt_tokens)
    count = min(len(blocks), len(memory))
    # Held anywhere, block by block (map/index run in C: a 128K-token prompt has 512 blocks).
    held = list(map(bool, memory[:count]))
    if disk is not None:
        held = list(map(or_, held, map(bool, disk[:count])))
    pool_blocks = held.index(False) if False in held else count
    resolve = endpoint_map.resolved.__getitem__
    runs: list[_Run] = []
    covered = 0
    # Runs of blocks on the same endpoints (disk-only blocks have none, so they run together).
    for endpoints, run in groupby(range(pool_blocks), key=memory.__getitem__):
        indices = list(run)
        tokens = min(sum(blocks[i].num_tokens for i in (indices[0], indices[-1]))
                     + blocks[indices[0]].num_tokens * max(0, len(indices) - 2)
                     if len(indices) > 1 else blocks[indices[0]].num_tokens,
                     num_prompt_tokens - covered)
        if tokens <= 0:
            break
        covered += tokens
        holders = frozenset().union(*map(resolve, endpoints)) if endpoints else frozenset()
        runs.append(_Run(tokens, Tier.NETWORK if endpoints else Tier.DISK, holders))
    return TieredHits(local, runs, engine)
