"""Passive outlier detection: eject an instance that fails real requests several times in a row.

Active health checks only see `GET /health`; an engine can pass them and still fail every
generation (a wedged scheduler, a broken GPU, a full disk). So the forwarder reports every
attempt's outcome here. A failure is what makes the gateway try another instance or cut a stream:
no connection, a 5xx, no first byte in time, an answer that broke. A success is any complete
answer, 4xx included (the engine worked; the client asked badly). `failures` in a row eject the
instance through the registry, the same ejection health checks use, for at least `ejection_s`;
after that the next passing health check readmits it. A success resets the count.

At most half of a model's instances are outlier-ejected at once (a lone instance never is): a
client can make engines fail on purpose (a request that crashes them), and that must not empty
the fleet. Health checks still eject any instance that stops answering them.
"""

from __future__ import annotations

import logging
import time

from kvgate.gateway.fleet.registry import InstanceRegistry, InstanceState
from kvgate.metrics.definitions import GatewayMetrics

log = logging.getLogger(__name__)

MAX_EJECTED_FRACTION = 0.5


class OutlierDetector:
    def __init__(self, registry: InstanceRegistry, metrics: GatewayMetrics, failures: int, ejection_s: float) -> None:
        self._registry = registry
        self._metrics = metrics
        self._failures = failures  # 0: off
        self._ejection_s = ejection_s

    def success(self, instance_id: str) -> None:
        state = self._registry.get(instance_id)
        if state is not None and state.failed_requests:
            state.failed_requests = 0

    def failure(self, instance_id: str, reason: str) -> None:
        state = self._registry.get(instance_id)
        if state is None or not self._failures:
            return
        state.failed_requests += 1
        if state.failed_requests < self._failures or not state.healthy or not self._may_eject(state):
            return
        log.warning("instance %s ejected for %.0fs: %d failed requests in a row, the last: %s",
                    instance_id, self._ejection_s, state.failed_requests, reason)
        self._registry.eject(state, until=time.monotonic() + self._ejection_s)
        self._metrics.outlier_ejections.labels(instance_id).inc()
        self._metrics.instance_healthy.labels(instance_id).set(0)

    def _may_eject(self, state: InstanceState) -> bool:
        now = time.monotonic()
        peers = [s for s in self._registry.states() if s.config.model == state.config.model]
        ejected = sum(1 for s in peers if not s.healthy and s.outlier_until > now)
        return ejected + 1 <= len(peers) * MAX_EJECTED_FRACTION
