"""Scheduling metrics, Llumnix style: each has a name, a value per candidate and a direction.
They are registered by name in registry.py.

A metric computes a whole column (one value per candidate) at once: with 1024 instances a Python
call per candidate and metric would cost more than the decision is allowed to take.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from itertools import repeat
from operator import attrgetter

from kvgate.scheduler.types import Candidate, RoutingRequest

_ids = attrgetter("id")


def hit_tokens_column(candidates: Sequence[Candidate], request: RoutingRequest) -> list[int]:
    """prefix_hit_tokens of each candidate (0 for an instance without a hit)."""
    return list(map(request.prefix_hit_tokens.get, map(_ids, candidates), repeat(0)))


def prefix_miss_tokens(num_prompt_tokens: int, prefix_hit_tokens: int) -> int:
    """Prompt tokens the instance must compute: the whole prompt where there is no hit.

    (Llumnix gives instances without a hit a miss of 0, which makes them look like full hits.)
    """
    return max(0, num_prompt_tokens - prefix_hit_tokens)


def miss_tokens_column(candidates: Sequence[Candidate], request: RoutingRequest) -> list[int]:
    """prefix_miss_tokens of each candidate, inlined: a call per candidate costs 1024 calls a decision."""
    prompt = request.num_prompt_tokens
    return [prompt - hit if hit < prompt else 0 for hit in hit_tokens_column(candidates, request)]


class SchedulingMetric(ABC):
    name: str
    less: bool = True  # lower values are better (Llumnix's `less`)

    @abstractmethod
    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        """The metric of every candidate, in candidate order."""

    def value(self, candidate: Candidate, request: RoutingRequest) -> float:
        return self.values((candidate,), request)[0]


class LoadMetric(SchedulingMetric):
    """A field of the candidate's InstanceLoad, read as is."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._read = attrgetter(f"load.{name}")

    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        return list(map(self._read, candidates))


class KvCacheHitLen(SchedulingMetric):
    name = "kv_cache_hit_len"
    less = False

    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        return hit_tokens_column(candidates, request)


class CacheAwareAllPrefillsTokensNum(SchedulingMetric):
    """Tokens the instance must prefill before this request's first token: our miss plus its queue.

    The queue counts `queued_tokens_weight` per token (Llumnix: 1). Below 1 a prefix holder keeps
    its requests through short bursts instead of seeding copies of the prefix on idle instances:
    every copy costs cache room that later requests of the same conversation would have hit, and
    with chunked prefill a new request shares the step budget instead of waiting for the whole queue.
    """

    name = "cache_aware_all_prefills_tokens_num"

    def __init__(self, queued_tokens_weight: float = 1.0) -> None:
        if not queued_tokens_weight >= 0:
            raise ValueError("the queued tokens weight must be >= 0")
        self._weight = queued_tokens_weight

    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        queued = map(attrgetter("load.all_prefills_tokens_num"), candidates)
        weight = self._weight
        return [
            miss + weight * q for miss, q in zip(miss_tokens_column(candidates, request), queued, strict=True)
        ]
