"""The load account as the forwarder feeds it, with the Prometheus gauges read from it.

`kvgate_inflight_requests` and `kvgate_inflight_prefill_tokens` are computed from the account when
/metrics is scraped, never counted on the side: they cannot drift from it, and the request path
pays nothing for them.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.account import LoadAccount


class InflightTracker:
    def __init__(
        self, account: LoadAccount, metrics: GatewayMetrics, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.account = account
        self._metrics = metrics
        self._clock = clock
        self._exported: set[str] = set()  # instances whose gauges read the account

    def dispatch(self, key: str, instance_id: str, uncomputed_tokens: int) -> None:
        self.account.dispatch(key, instance_id, uncomputed_tokens, self._clock())
        if instance_id not in self._exported:
            self._export(instance_id)

    def first_token(self, key: str) -> None:
        self.account.first_token(key, self._clock())

    def release(self, key: str) -> None:
        """Idempotent: every exit path of a forward calls it, some paths twice."""
        self.account.release(key)

    def expire(self) -> None:
        """Drop stale dispatch entries (the account's safety net)."""
        self.account.expire(self._clock())

    def _export(self, instance_id: str) -> None:
        account = self.account
        self._metrics.inflight_requests.labels(instance_id).set_function(lambda: account.inflight(instance_id)[0])
        self._metrics.inflight_prefill_tokens.labels(instance_id).set_function(
            lambda: account.inflight(instance_id)[1])
        self._exported.add(instance_id)
