"""Rank candidates metric by metric: the first strict difference decides, ties fall through.

Candidates still tied after the last metric are ordered by a rotating cursor over instance ids:
ids after the previous pick first, in id order, then the wrap-around. Without it every tie (a cold
start, an idle fleet) goes to the same first instance, the hot spot Llumnix and peer routers show.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import overload

from kvgate.scheduler.scheduling_metrics import SchedulingMetric, prefix_miss_tokens
from kvgate.scheduler.types import Candidate, Decision, InstanceScore, RoutingRequest


class Selector:
    def __init__(self, top_k: int = 1, rng: random.Random | None = None) -> None:
        if top_k < 1:
            raise ValueError("top_k must be at least 1")
        self._top_k = top_k
        # Seeded by default so that a replayed trace makes the same choices.
        self._rng = rng if rng is not None else random.Random(0)
        self._last_pick = ""  # instance ids are non-empty, so "" puts every id after the cursor

    def select(
        self,
        metrics: Sequence[SchedulingMetric],
        candidates: Sequence[Candidate],
        request: RoutingRequest,
        cache_aware: bool,
    ) -> Decision:
        """Best first. With top_k > 1 the first place goes to one of the k best at random."""
        if not candidates:
            return Decision(selected=None, ranking=(), scores=(), cache_aware=cache_aware,
                            predictions=request.predictions)
        ids = [candidate.id for candidate in candidates]
        columns = [metric.values(candidates, request) for metric in metrics]
        # One key tuple per candidate, then a single sort: no Python call per comparison.
        ascending = [
            col if metric.less else [-v for v in col] for metric, col in zip(metrics, columns, strict=True)
        ]
        last = self._last_pick
        keys = list(zip(*ascending, [id_ <= last for id_ in ids], ids, strict=True))
        order = sorted(range(len(ids)), key=keys.__getitem__)
        if self._top_k > 1:
            order.insert(0, order.pop(self._rng.randrange(min(self._top_k, len(order)))))
        self._last_pick = ids[order[0]]
        return Decision(
            selected=ids[order[0]],
            ranking=tuple(ids[i] for i in order),
            scores=ScoreTable(metrics, columns, candidates, order, request),
            cache_aware=cache_aware,
            predictions=request.predictions,
        )


class ScoreTable(Sequence[InstanceScore]):
    """Decision.scores, in ranking order; each InstanceScore is built when read.

    Building 1024 scores with their metric dicts costs more than the whole ranking, and most
    decisions only read the winner's. Compares equal to a tuple of the same scores.
    """

    __slots__ = ("_metrics", "_columns", "_candidates", "_order", "_request")

    def __init__(
        self,
        metrics: Sequence[SchedulingMetric],
        columns: list[list[float]],
        candidates: Sequence[Candidate],
        order: list[int],
        request: RoutingRequest,
    ) -> None:
        self._metrics, self._columns, self._candidates = metrics, columns, candidates
        self._order, self._request = order, request

    def __len__(self) -> int:
        return len(self._order)

    @overload
    def __getitem__(self, index: int) -> InstanceScore: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[InstanceScore, ...]: ...

    def __getitem__(self, index: int | slice) -> InstanceScore | tuple[InstanceScore, ...]:
        if isinstance(index, slice):
            return tuple(self[i] for i in range(*index.indices(len(self))))
        position = self._order[index]
        candidate = self._candidates[position]
        hit = self._request.prefix_hit_tokens.get(candidate.id, 0)
        return InstanceScore(
            candidate.id,
            hit,
            prefix_miss_tokens(self._request.num_prompt_tokens, hit),
            {
                metric.name: column[position]
                for metric, column in zip(self._metrics, self._columns, strict=True)
            },
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]  # mutable-looking and compared by content

    def __repr__(self) -> str:
        return f"ScoreTable({list(self)!r})"
