"""Rank candidates metric by metric: the first strict difference decides, ties fall through.

Candidates still tied after the last metric are ordered by a rotating cursor over instance ids:
ids after the previous pick first, in id order, then the wrap-around. Without it every tie (a cold
start, an idle fleet) goes to the same first instance, the hot spot Llumnix and peer routers show.

The full ranking is sorted only when something reads past its first place (a retry, the debug
route): among 1024 instances the sort costs a third of the decision, and most requests only need
the winner, found by one min().
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
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
        # The position last: equal keys cannot happen (ids are unique), and the winner's key names it.
        keys = list(zip(*ascending, [id_ <= last for id_ in ids], ids, range(len(ids)), strict=True))
        order = RankingOrder(keys)
        if self._top_k > 1:
            rng = self._rng
            if request.dry_run:
                rng = random.Random()
                rng.setstate(self._rng.getstate())
            order.promote(rng.randrange(min(self._top_k, len(keys))))
        if not request.dry_run:
            self._last_pick = ids[order[0]]
        return Decision(
            selected=ids[order[0]],
            ranking=Ranking(ids, order),
            scores=ScoreTable(metrics, columns, candidates, order, request),
            cache_aware=cache_aware,
            predictions=request.predictions,
        )


class RankingOrder(Sequence[int]):
    """Candidate positions, best first: the first by min(), the rest sorted on first need."""

    __slots__ = ("_keys", "_first", "_sorted")

    def __init__(self, keys: list[tuple]) -> None:
        self._keys = keys
        self._first: int = min(keys)[-1]
        self._sorted: list[int] | None = None

    def promote(self, place: int) -> None:
        """Move the candidate at `place` to the front (top_k > 1 picks among the k best)."""
        order = self._full()
        order.insert(0, order.pop(place))
        self._first = order[0]

    def _full(self) -> list[int]:
        if self._sorted is None:
            self._sorted = [key[-1] for key in sorted(self._keys)]
        return self._sorted

    def __len__(self) -> int:
        return len(self._keys)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        if index == 0:
            return self._first
        return self._full()[index]

    def __iter__(self) -> Iterator[int]:
        yield self._first
        yield from self._full()[1:]


class Ranking(Sequence[str]):
    """Decision.ranking: instance ids best first; compares equal to a tuple of the same ids."""

    __slots__ = ("_ids", "_order")

    def __init__(self, ids: list[str], order: RankingOrder) -> None:
        self._ids, self._order = ids, order

    def __len__(self) -> int:
        return len(self._ids)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[str, ...]: ...

    def __getitem__(self, index: int | slice) -> str | tuple[str, ...]:
        if isinstance(index, slice):
            return tuple(self._ids[i] for i in self._order[index])
        return self._ids[self._order[index]]

    def __iter__(self) -> Iterator[str]:
        return map(self._ids.__getitem__, self._order)

    def index(self, value: object, start: int = 0, stop: int | None = None) -> int:
        if start == 0 and value == self._ids[self._order[0]]:
            return 0  # the winner: no sort
        return list(self).index(value, start, len(self) if stop is None else stop)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Sequence) and tuple(self) == tuple(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Ranking({tuple(self)!r})"


class ScoreTable(Sequence[InstanceScore]):
    """Decision.scores, in ranking order; each InstanceScore is built when first read.

    Building 1024 scores with their metric dicts costs more than the whole ranking, and most
    decisions only read the winner's (several times: dispatch, hit ratio, hit accounting, access
    log), so a built score is kept. Compares equal to a tuple of the same scores.
    """

    __slots__ = ("_metrics", "_columns", "_candidates", "_order", "_request", "_built")

    def __init__(
        self,
        metrics: Sequence[SchedulingMetric],
        columns: list[list[float]],
        candidates: Sequence[Candidate],
        order: Sequence[int],
        request: RoutingRequest,
    ) -> None:
        self._metrics, self._columns, self._candidates = metrics, columns, candidates
        self._order, self._request = order, request
        self._built: dict[int, InstanceScore] = {}  # by candidate position

    def longest_prefix_hit(self) -> int:
        """The longest prefix hit of any candidate, without building their scores."""
        hits = self._request.prefix_hit_tokens
        return max((hits.get(candidate.id, 0) for candidate in self._candidates), default=0) if hits else 0

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
        score = self._built.get(position)
        if score is None:
            score = self._built[position] = self._build(position)
        return score

    def _build(self, position: int) -> InstanceScore:
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
