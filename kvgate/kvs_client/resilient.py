"""Retry, time budget and down-gating around any KVSBackend: the KVS is advice, never a blocker.

Rules (Llumnix's flag names):
- A lookup tries the backend, retrying failed attempts `kvs_retry_interval_ms` apart while
  another attempt still fits in the lookup's time budget.
- The whole lookup, retries included, is bounded by `kvs_query_budget_ms`; when the budget runs
  out the lookup returns status "error" with no hits.
- Failed attempts (errors and budget expiries) are counted across lookups; after
  1 + `kvs_retry_times` consecutive failures the store is marked down for
  `kvs_metadata_service_down_duration_s`. Counting across lookups matters: with a budget
  shorter than the retry interval a single lookup never gets to retry, yet a dead store must
  still stop costing every request its full budget. Any success resets the count.
- While down, lookups return status "down" at once without asking. When the down period ends,
  the next lookup is a single-attempt probe; lookups arriving while it runs stay "down". A
  successful probe brings the store back; a failed one marks it down for another period.
- `lookup` never raises (except cancellation, which belongs to the caller).
- Only the first `kvs_max_query_blocks` keys are asked: hits count from block 0 on, so those
  decide the ranking; the rest are answered as held nowhere. This bounds the request and the answer.

`clock` drives the down period only (tests pass a fake one); budgets use the event loop's clock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence

from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, wait_fixed

from kvgate.config.settings import Settings
from kvgate.kvs_client.base import (
    HashedPrompt,
    KVSAnswer,
    KVSAnswerTooLarge,
    KVSBackend,
    KVSLookup,
    KVSQueryError,
)
from kvgate.metrics.definitions import KVSMetrics

log = logging.getLogger(__name__)


class ResilientKVSClient:
    def __init__(
        self,
        backend: KVSBackend,
        settings: Settings,
        metrics: KVSMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.backend = backend
        self.retry_times = settings.kvs_retry_times
        self.retry_interval_s = settings.kvs_retry_interval_ms / 1000
        self.down_duration_s = settings.kvs_metadata_service_down_duration_s
        self.budget_s = settings.kvs_query_budget_ms / 1000
        # An in-process index answers without ever suspending, so a budget timer could never
        # interrupt it; arming and cancelling one costs more than the lookup (~5 us).
        self._answers_inline = getattr(backend, "answers_inline", False)
        self.max_query_blocks = settings.kvs_max_query_blocks
        self._metrics = metrics
        self._clock = clock
        self._consecutive_failures = 0
        self._down_until: float | None = None
        self._probe_running = False
        self.last_error: str | None = None
        # Labelled children resolved once: labels() per lookup costs more than the observation.
        self._query_seconds = metrics.query_seconds.labels(self.name) if metrics else None
        self._keys_per_query = metrics.keys_per_query.labels(self.name) if metrics else None
        self._outcomes = {outcome: metrics.query_outcomes.labels(self.name, outcome)
                          for outcome in ("hit", "miss", "error", "skipped_down")} if metrics else {}
        self._set_up_gauge(True)

    @property
    def name(self) -> str:
        return self.backend.name

    @property
    def is_down(self) -> bool:
        """True from being marked down until a probe succeeds."""
        return self._down_until is not None

    async def lookup(
        self, keys: Sequence[str], token_ids: Sequence[int] | None = None, model: str = ""
    ) -> KVSLookup:
        """Where `keys` are held. `token_ids` (the ids the keys were hashed from) and `model` are for
        a store that hashes the prompt itself (the Conductor indexer); the others ignore them."""
        started = time.perf_counter()
        if not keys:
            return KVSLookup.empty("skipped", 0)
        unasked = max(len(keys) - self.max_query_blocks, 0)
        if unasked:
            # The backend asks only the token ids the asked keys cover.
            lookup = await self.lookup(keys[: self.max_query_blocks], token_ids, model)
            nothing: list[tuple[str, ...]] = [()] * unasked
            return KVSLookup(lookup.status, lookup.locations + nothing, lookup.disk_locations + nothing,
                             lookup.elapsed_s)
        probe = False
        if self._down_until is not None:
            if self._probe_running or self._clock() < self._down_until:
                self._count("skipped_down")
                return KVSLookup.empty("down", len(keys), time.perf_counter() - started)
            probe = self._probe_running = True
        prompt = None if token_ids is None else HashedPrompt(token_ids, model)
        try:
            answer = await self._ask(keys, prompt, probe)
        except Exception as exc:
            if not isinstance(exc, KVSQueryError):
                # A backend bug is still only a miss for the request, never a 500.
                self._record_failure(exc, probe)
            return self._finish(KVSLookup.empty("error", len(keys), time.perf_counter() - started), len(keys))
        finally:
            if probe:
                self._probe_running = False
        self._record_success()
        lookup = KVSLookup(
            "ok",
            [answer.locations.get(key, ()) for key in keys],
            [answer.disk_locations.get(key, ()) for key in keys],
            time.perf_counter() - started,
        )
        return self._finish(lookup, len(keys))

    async def close(self) -> None:
        await self.backend.close()

    async def _ask(self, keys: Sequence[str], prompt: HashedPrompt | None, probe: bool) -> KVSAnswer:
        """The backend's answer, or KVSQueryError once every failed attempt has been recorded."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.budget_s
        # The first attempt, which almost always answers, without building the retry machinery
        # (a tenacity loop costs ~30 us a lookup on the request path).
        try:
            if self._answers_inline:
                return await self.backend.query(keys, prompt)
            async with asyncio.timeout_at(deadline):
                return await self.backend.query(keys, prompt)
        except KVSQueryError as exc:
            self._record_failure(exc, probe)
            if probe or self.retry_times == 0:
                raise
        except TimeoutError as exc:
            self._record_failure(exc, probe)
            raise KVSQueryError(f"time budget of {self.budget_s * 1000:.0f} ms exhausted") from exc
        return await self._retry(keys, prompt, deadline)

    async def _retry(self, keys: Sequence[str], prompt: HashedPrompt | None, deadline: float) -> KVSAnswer:
        """Up to `retry_times` more attempts after a failed first one, within the same budget (a
        probe is never retried)."""
        loop = asyncio.get_running_loop()
        max_attempts = self.retry_times
        if loop.time() + self.retry_interval_s >= deadline or self.is_down:
            raise KVSQueryError("the KV store failed and no retry fits the budget")
        await asyncio.sleep(self.retry_interval_s)

        def stop(state: RetryCallState) -> bool:
            # Stop when attempts are used up, the next one would start past the budget, or a
            # concurrent lookup has meanwhile marked the store down.
            return (
                state.attempt_number >= max_attempts
                or loop.time() + self.retry_interval_s >= deadline
                or self.is_down
            )

        retrying = AsyncRetrying(
            stop=stop, wait=wait_fixed(self.retry_interval_s), retry=retry_if_exception_type(KVSQueryError),
            reraise=True,
        )
        calling = False
        try:
            async with asyncio.timeout_at(deadline):
                async for attempt in retrying:
                    with attempt:
                        calling = True
                        try:
                            answer = await self.backend.query(keys, prompt)
                        except KVSQueryError as exc:
                            calling = False
                            self._record_failure(exc, probe=False)
                            raise
                        return answer
        except TimeoutError as exc:
            # Only a call cut short counts as a failure; running out of budget while waiting
            # to retry was already counted by the attempt that failed.
            if calling:
                self._record_failure(exc, probe=False)
            raise KVSQueryError(f"time budget of {self.budget_s * 1000:.0f} ms exhausted") from exc
        raise AssertionError("unreachable: tenacity returns or reraises")

    def _record_failure(self, exc: BaseException, probe: bool) -> None:
        reason = "time budget exhausted" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
        if isinstance(exc, KVSAnswerTooLarge) and self._metrics is not None:
            self._metrics.oversized_answers.labels(self.name).inc()
        self.last_error = reason
        self._consecutive_failures += 1
        already_down = self._down_until is not None and not probe
        if already_down or (not probe and self._consecutive_failures <= self.retry_times):
            return
        self._down_until = self._clock() + self.down_duration_s
        self._set_up_gauge(False)
        log.warning(
            "KV store %s marked down for %.1fs (%s); last error: %s",
            self.name, self.down_duration_s,
            "probe failed" if probe else f"{self._consecutive_failures} consecutive failures", reason,
        )

    def _record_success(self) -> None:
        self._consecutive_failures = 0
        if self._down_until is not None:
            self._down_until = None
            self._set_up_gauge(True)
            log.warning("KV store %s answers again; lookups resume", self.name)

    def _finish(self, lookup: KVSLookup, key_count: int) -> KVSLookup:
        if self._query_seconds is not None and self._keys_per_query is not None:
            self._query_seconds.observe(lookup.elapsed_s)
            self._keys_per_query.observe(key_count)
        if lookup.status == "error":
            self._count("error")
        else:
            self._count("hit" if lookup.hit_count else "miss")
        return lookup

    def _count(self, outcome: str) -> None:
        if outcome in self._outcomes:
            self._outcomes[outcome].inc()

    def _set_up_gauge(self, up: bool) -> None:
        if self._metrics is not None:
            self._metrics.service_up.labels(self.name).set(1 if up else 0)
