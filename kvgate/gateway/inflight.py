"""The load account as the forwarder feeds it, with the Prometheus gauges kept equal to it.

Every change goes through here so `kvgate_inflight_requests` and `kvgate_inflight_prefill_tokens`
are always read back from the account itself, never counted on the side.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.account import LoadAccount


class InflightTracker:
    def __init__(
        self, account: LoadAccount, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.account = account
        self._metrics = metrics
        self._clock = clock
        self._instance_of: dict[str, str] = {}  # account key -> instance id
        # Per instance (requests gauge, prefill tokens gauge); labels() costs microseconds per call.
        self._gauges: dict[str, tuple[Any, Any]] = {}

    def dispatch(self, key: str, instance_id: str, uncomputed_tokens: int) -> None:
        self.account.dispatch(key, instance_id, uncomputed_tokens, self._clock())
        self._instance_of[key] = instance_id
        self._sync(instance_id)

    def first_token(self, key: str) -> None:
        self.account.first_token(key, self._clock())
        self._sync(self._instance_of.get(key))

    def release(self, key: str) -> None:
        """Idempotent: every exit path of a forward calls it, some paths twice."""
        self.account.release(key)
        self._sync(self._instance_of.pop(key, None))

    def expire(self) -> None:
        """Drop stale dispatch entries (the account's safety net) and refresh every gauge."""
        self.account.expire(self._clock())
        for instance_id in self._gauges:
            self._sync(instance_id)

    def _sync(self, instance_id: str | None) -> None:
        if instance_id is None:
            return
        gauges = self._gauges.get(instance_id)
        if gauges is None:
            gauges = self._gauges[instance_id] = (
                self._metrics.inflight_requests.labels(instance_id),
                self._metrics.inflight_prefill_tokens.labels(instance_id),
            )
        requests, prefill_tokens = self.account.inflight(instance_id)
        gauges[0].set(requests)
        gauges[1].set(prefill_tokens)
