"""Several gateway replicas in the simulator: one load account each, the trace dealt round-robin.

Behind a load balancer every replica decides with its own account. Blind (no account sync), a
replica sees only what it sent itself (and the engines' scraped stats, seconds late), so several
replicas pile long prompts on the same "least loaded" instance. Synced, each replica folds in the
others' rows as `--account-sync` does: every `sync_interval_s` a replica publishes its rows and reads
the others' latest publications, the replicas' rounds spread evenly over the interval, so what a
replica knows of the others is between 0 and 2 intervals old, as with Redis (docs/SCALEOUT.md).

`GatewayReplicas` offers the calls the replay makes on one `LoadAccount`, plus `sync_until(now)`,
which the replay calls before each decision. Sync rounds due before an account event are run when
that event arrives, so each round sees the rows as they stood at its time (only `release`, which
carries no time, may be applied up to one engine step before a round).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from kvgate.scheduler.account import ZERO, Counts, LoadAccount, LocalRows
from kvgate.scheduler.types import EngineStats, InstanceLoad
from kvgate.simulator.trace import TraceRequest


def spread_bursts(requests: Sequence[TraceRequest]) -> list[TraceRequest]:
    """Requests recorded at one timestamp, spaced evenly until the next recorded timestamp.

    The conversation trace records arrivals at 3-second granularity: ~10 requests at the very same
    instant. No sync can tell replicas about a dispatch made at the instant they decide, so
    replayed as recorded, bursts hide what sync does for traffic that really arrives spread out.
    """
    spread: list[TraceRequest] = []
    groups = [list(group) for _, group in itertools.groupby(requests, key=lambda r: r.arrival_s)]
    for group, following in zip(groups, [*groups[1:], None], strict=True):
        span = following[0].arrival_s - group[0].arrival_s if following else 0.0
        step = span / len(group)
        spread += [dataclasses.replace(r, arrival_s=r.arrival_s + k * step) for k, r in enumerate(group)]
    return spread


class GatewayReplicas:
    def __init__(self, count: int, staleness_s: float, sync_interval_s: float | None) -> None:
        if count < 1:
            raise ValueError("gateway replicas must be at least 1")
        self._rows = [LocalRows() for _ in range(count)]
        self.accounts = [LoadAccount(staleness_s, rows) for rows in self._rows]
        self._owner: dict[str, int] = {}
        self._next = 0  # the replica the load balancer gives the next arrival
        self._interval = sync_interval_s
        # Replica r runs its rounds at r/count of the interval: phases spread evenly.
        self._next_round = [math.inf] * count if sync_interval_s is None else [
            r * sync_interval_s / count for r in range(count)]
        self._published: list[dict[str, Counts]] = [{} for _ in range(count)]

    # --- what the replay calls ---

    def load(self, instance_id: str) -> InstanceLoad:
        """As the replica taking the next arrival sees it."""
        return self.accounts[self._next].load(instance_id)

    def dispatch(self, request_id: str, instance_id: str, uncomputed_tokens: int, now: float) -> None:
        self.sync_until(now)
        self.accounts[self._next].dispatch(request_id, instance_id, uncomputed_tokens, now)
        self._owner[request_id] = self._next
        self._next = (self._next + 1) % len(self.accounts)

    def first_token(self, request_id: str, now: float) -> None:
        self.sync_until(now)
        owner = self._owner.get(request_id)
        if owner is not None:
            self.accounts[owner].first_token(request_id, now)

    def release(self, request_id: str) -> None:
        owner = self._owner.pop(request_id, None)
        if owner is not None:
            self.accounts[owner].release(request_id)

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None:
        """Every replica scrapes the engines itself."""
        for account in self.accounts:
            account.observe_engine(instance_id, stats, now)

    def expire(self, now: float) -> list[str]:
        self.sync_until(now)
        expired = [rid for account in self.accounts for rid in account.expire(now)]
        for rid in expired:
            self._owner.pop(rid, None)
        return expired

    def total_inflight(self) -> int:
        return sum(account.total_inflight() for account in self.accounts)

    # --- account sync ---

    def sync_until(self, now: float) -> None:
        """Run every sync round due by `now` (the replay calls it before each decision)."""
        if self._interval is None:
            return
        while True:
            replica = min(range(len(self._next_round)), key=self._next_round.__getitem__)
            if self._next_round[replica] > now:
                return
            self._round(replica)
            self._next_round[replica] += self._interval

    def _round(self, replica: int) -> None:
        """Publish this replica's rows, fold in the others' latest publications."""
        self._published[replica] = self._rows[replica].local_totals()
        remote: dict[str, Counts] = {}
        for other, published in enumerate(self._published):
            if other == replica:
                continue
            for instance_id, (requests, awaiting, tokens) in published.items():
                r, a, t = remote.get(instance_id, ZERO)
                remote[instance_id] = (r + requests, a + awaiting, t + tokens)
        self._rows[replica].set_remote(remote)
