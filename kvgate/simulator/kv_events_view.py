"""The gateway's view of each instance's own prefix cache as its KV events report it: late.

An engine publishes the blocks one step stored and evicted as one batch once the step is over
(vLLM takes a step's events after it); the gateway's index applies that batch after the
publisher's queue, the network and the subscriber have passed it on: the event lag. Here each
simulated step's cache changes become one batch, applied to the index `lag_s` after the step
ends, batches in order. Until then the gateway routes on what it knew: blocks it thinks an
instance holds that are gone, blocks it does not know are there.

Only lookups read the index, so due batches are applied when the next lookup happens
(`deliver_until`), not by events of their own.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from kvgate.kvs_client.embedded import EmbeddedKVSIndex


class _StepChanges:
    """What one step stored and evicted. Every eviction of a step happens while it admits requests,
    before any block it stores (computed or loaded) is in HBM, so a batch applies its evictions first."""

    __slots__ = ("added", "evicted")

    def __init__(self) -> None:
        self.added: list[str] = []
        self.evicted: list[str] = []


class KVEventsView:
    def __init__(self, index: EmbeddedKVSIndex, lag_s: float) -> None:
        if lag_s < 0:
            raise ValueError("the KV event lag must be >= 0")
        self.index = index
        self.lag_s = lag_s
        self._open: dict[str, _StepChanges] = {}  # endpoint -> changes of the step it is running
        self._due: list[tuple[float, int, str, _StepChanges]] = []  # (visible at, order, endpoint, changes)
        self._order = itertools.count()

    def recorder(self, endpoint: str) -> Callable[[list[str], list[str]], None]:
        """The engine core's cache-change callback for the instance publishing as `endpoint`."""
        open_steps = self._open
        open_steps.setdefault(endpoint, _StepChanges())

        def record(added: list[str], evicted: list[str]) -> None:
            changes = open_steps[endpoint]
            changes.added += added
            changes.evicted += evicted

        return record

    def step_ends(self, endpoint: str, at: float) -> None:
        """The instance's step ends at `at`: what it changed is published then, seen `lag_s` later."""
        changes = self._open[endpoint]
        if changes.added or changes.evicted:
            heapq.heappush(self._due, (at + self.lag_s, next(self._order), endpoint, changes))
            self._open[endpoint] = _StepChanges()

    def deliver_until(self, now: float) -> None:
        """Apply every batch the gateway has received by `now`."""
        due, index = self._due, self.index
        while due and due[0][0] <= now:
            _, _, endpoint, changes = heapq.heappop(due)
            index.remove(changes.evicted, endpoint)
            index.add(changes.added, endpoint)
