"""The dispatch account: what the gateway sent where, merged with what engines report.

Engines report their queues a scrape interval late. Two decisions a millisecond apart must see each
other, so every dispatch is recorded here synchronously, before the request is forwarded, and
leaves on every path: first token (prefill done), then finish, error, retry, cancel - or, as a
safety net, after `staleness_s` without news (REFERENCE.md section 4).

Merge rule (`load`), per instance:
- num_requests = max(engine running + waiting, account in flight)
- num_waiting_requests = max(engine waiting, account awaiting their first token)
- all_prefills_tokens_num = uncomputed prompt tokens of account requests awaiting their first token
  (engines do not export queued token counts; those requests cover both queued and running prefills)
- kv_cache_usage_ratio = the engine's (0 until it has reported)
The max() takes the engine's view when other clients share it and ours when its report is stale.

Where the per-instance counters live is injected (`AccountRows`): this module's `LocalRows` for one
process; the gateway's shared-memory rows when several worker processes (and, through Redis,
several replicas) share one account. Each account writes only its own row, with absolute values,
and reads the sum of every row, so writers never contend and nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from kvgate.scheduler.types import EngineStats, InstanceLoad

__all__ = ["AccountRows", "Counts", "EngineStats", "LoadAccount", "LocalRows"]

# One row's counters for one instance: (requests in flight, requests awaiting their first token,
# uncomputed prompt tokens of those requests).
Counts = tuple[int, int, int]
ZERO: Counts = (0, 0, 0)


class AccountRows(Protocol):
    """Per-instance counters: one row per writer (an account), summed by readers."""

    def write(self, instance_id: str, counts: Counts) -> None:
        """Set this writer's row for `instance_id` (absolute values, never increments)."""

    def summed(self, instance_id: str) -> Counts:
        """Every row for `instance_id` added up: this writer's, its peers', remote replicas'."""

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None: ...

    def engine(self, instance_id: str) -> EngineStats | None: ...

    def expire_engine(self, older_than: float) -> None:
        """Forget engine reports last updated before `older_than`."""


class LocalRows:
    """The rows of one process: its own counters plus, when replicas sync, the others' sums."""

    def __init__(self) -> None:
        self._own: dict[str, Counts] = {}
        self._remote: Mapping[str, Counts] = {}
        self._engine: dict[str, tuple[EngineStats, float]] = {}

    def write(self, instance_id: str, counts: Counts) -> None:
        if counts == ZERO:
            self._own.pop(instance_id, None)  # removed instances leave no trace
        else:
            self._own[instance_id] = counts

    def summed(self, instance_id: str) -> Counts:
        own = self._own.get(instance_id, ZERO)
        remote = self._remote.get(instance_id)
        if remote is None:
            return own
        return own[0] + remote[0], own[1] + remote[1], own[2] + remote[2]

    def local_totals(self) -> dict[str, Counts]:
        """What this process sent (what a replica publishes to the others)."""
        return dict(self._own)

    def set_remote(self, totals: Mapping[str, Counts]) -> None:
        """The other replicas' sums, replaced whole by the account sync."""
        self._remote = totals

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None:
        self._engine[instance_id] = (stats, now)

    def engine(self, instance_id: str) -> EngineStats | None:
        reported = self._engine.get(instance_id)
        return reported[0] if reported else None

    def expire_engine(self, older_than: float) -> None:
        for instance_id in [i for i, (_, seen) in self._engine.items() if seen < older_than]:
            del self._engine[instance_id]


@dataclass(slots=True)
class _Entry:
    instance_id: str
    uncomputed_tokens: int
    awaiting_first_token: bool
    updated_at: float


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    awaiting_first_token: int = 0
    prefill_tokens: int = 0


class LoadAccount:
    def __init__(self, staleness_s: float, rows: AccountRows | None = None) -> None:
        if staleness_s <= 0:
            raise ValueError("staleness_s must be positive")
        self._staleness_s = staleness_s
        self.rows: AccountRows = rows if rows is not None else LocalRows()
        self._entries: dict[str, _Entry] = {}
        # This account's own counters, the source of truth for its row.
        self._totals: dict[str, _Totals] = {}

    def _publish(self, instance_id: str, totals: _Totals) -> None:
        self.rows.write(instance_id, (totals.requests, totals.awaiting_first_token, totals.prefill_tokens))

    def dispatch(self, request_id: str, instance_id: str, uncomputed_tokens: int, now: float) -> None:
        """Record a request sent to `instance_id`; a known request_id (a retry) moves there."""
        self.release(request_id)
        self._entries[request_id] = _Entry(instance_id, uncomputed_tokens, True, now)
        totals = self._totals.setdefault(instance_id, _Totals())
        totals.requests += 1
        totals.awaiting_first_token += 1
        totals.prefill_tokens += uncomputed_tokens
        self._publish(instance_id, totals)

    def first_token(self, request_id: str, now: float) -> None:
        """The prefill is done: the request leaves the prefill account but stays in flight."""
        entry = self._entries.get(request_id)
        if entry is None:
            return
        entry.updated_at = now
        if entry.awaiting_first_token:
            entry.awaiting_first_token = False
            totals = self._totals[entry.instance_id]
            totals.awaiting_first_token -= 1
            totals.prefill_tokens -= entry.uncomputed_tokens
            self._publish(entry.instance_id, totals)

    def release(self, request_id: str) -> None:
        """Finish, error, retry or cancel. Idempotent: an unknown or released id is a no-op."""
        entry = self._entries.pop(request_id, None)
        if entry is None:
            return
        totals = self._totals[entry.instance_id]
        totals.requests -= 1
        if entry.awaiting_first_token:
            totals.awaiting_first_token -= 1
            totals.prefill_tokens -= entry.uncomputed_tokens
        self._publish(entry.instance_id, totals)
        if totals.requests == 0:
            del self._totals[entry.instance_id]  # removed instances leave no trace

    def expire(self, now: float) -> list[str]:
        """Drop requests and engine reports not updated for `staleness_s`; returns the request ids.

        A request still streaming after that long is in the engine's own numbers, which the
        merge uses; its owner's later release() is then a no-op.
        """
        stale = [rid for rid, entry in self._entries.items() if now - entry.updated_at > self._staleness_s]
        for request_id in stale:
            self.release(request_id)
        self.rows.expire_engine(now - self._staleness_s)
        return stale

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None:
        self.rows.observe_engine(instance_id, stats, now)

    def load(self, instance_id: str) -> InstanceLoad:
        """The merged load, counting every row: every worker's and every synced replica's dispatches."""
        requests, awaiting, prefill_tokens = self.rows.summed(instance_id)
        engine = self.rows.engine(instance_id)
        if engine is None:
            return InstanceLoad(requests, awaiting, prefill_tokens, 0.0)
        return InstanceLoad(
            num_requests=max(engine.num_running + engine.num_waiting, requests),
            num_waiting_requests=max(engine.num_waiting, awaiting),
            all_prefills_tokens_num=prefill_tokens,
            kv_cache_usage_ratio=engine.kv_cache_usage_ratio,
        )

    def inflight(self, instance_id: str) -> tuple[int, int]:
        """(requests in flight, prefill tokens awaiting a first token) sent there, every row counted."""
        requests, _, prefill_tokens = self.rows.summed(instance_id)
        return requests, prefill_tokens

    def total_inflight(self) -> int:
        """Requests this account itself holds (the ones its owner must still release)."""
        return len(self._entries)
