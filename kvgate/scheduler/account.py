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
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.scheduler.types import EngineStats, InstanceLoad

__all__ = ["EngineStats", "LoadAccount"]


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
    def __init__(self, staleness_s: float) -> None:
        if staleness_s <= 0:
            raise ValueError("staleness_s must be positive")
        self._staleness_s = staleness_s
        self._entries: dict[str, _Entry] = {}
        self._totals: dict[str, _Totals] = {}
        self._engine: dict[str, tuple[EngineStats, float]] = {}

    def dispatch(self, request_id: str, instance_id: str, uncomputed_tokens: int, now: float) -> None:
        """Record a request sent to `instance_id`; a known request_id (a retry) moves there."""
        self.release(request_id)
        self._entries[request_id] = _Entry(instance_id, uncomputed_tokens, True, now)
        totals = self._totals.setdefault(instance_id, _Totals())
        totals.requests += 1
        totals.awaiting_first_token += 1
        totals.prefill_tokens += uncomputed_tokens

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
        for instance_id in [i for i, (_, seen) in self._engine.items() if now - seen > self._staleness_s]:
            del self._engine[instance_id]
        return stale

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None:
        self._engine[instance_id] = (stats, now)

    def load(self, instance_id: str) -> InstanceLoad:
        totals = self._totals.get(instance_id) or _Totals()
        reported = self._engine.get(instance_id)
        engine = reported[0] if reported else EngineStats(0, 0, 0.0)
        return InstanceLoad(
            num_requests=max(engine.num_running + engine.num_waiting, totals.requests),
            num_waiting_requests=max(engine.num_waiting, totals.awaiting_first_token),
            all_prefills_tokens_num=totals.prefill_tokens,
            kv_cache_usage_ratio=engine.kv_cache_usage_ratio,
        )

    def inflight(self, instance_id: str) -> tuple[int, int]:
        """(requests in flight, prefill tokens awaiting a first token) that the gateway sent there."""
        totals = self._totals.get(instance_id) or _Totals()
        return totals.requests, totals.prefill_tokens

    def total_inflight(self) -> int:
        return len(self._entries)
