"""Active health checks: GET /health on every instance, eject after N failures, readmit on success.

When they eject every instance of a model (in one role), the registry keeps routing to them (panic,
registry.py): this says so in `kvgate_routing_panic{model}` and in one log line per transition.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.metrics.definitions import GatewayMetrics

log = logging.getLogger(__name__)


class HealthChecker:
    def __init__(
        self,
        registry: InstanceRegistry,
        session: aiohttp.ClientSession,
        metrics: GatewayMetrics,
        failures_to_eject: int,
        timeout_s: float,
    ) -> None:
        self._registry = registry
        self._session = session
        self._metrics = metrics
        self._failures_to_eject = failures_to_eject
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._panicking: dict[str, bool] = {}

    async def check_all(self) -> None:
        states = self._registry.states()
        results = await asyncio.gather(*(self._probe(state.config.url) for state in states))
        for state, ok in zip(states, results, strict=True):
            was_healthy = state.healthy
            self._registry.record_health(state.id, ok, self._failures_to_eject)
            if state.healthy != was_healthy:
                log.warning("instance %s is now %s", state.id, "healthy" if state.healthy else "ejected")
            if self._registry.get(state.id) is state:  # not removed meanwhile
                self._metrics.instance_healthy.labels(state.id).set(1 if state.healthy else 0)
        self._report_panic()

    def _report_panic(self) -> None:
        for model in self._registry.models():
            panic = self._registry.panicking(model)
            if panic != self._panicking.get(model, False):
                if panic:
                    log.warning("every instance of model %s (in one role) fails its health checks: routing to them "
                                "anyway (panic) rather than refusing every request", model)
                else:
                    log.warning("model %s has a healthy instance again: panic routing is over", model)
            self._panicking[model] = panic
            self._metrics.routing_panic.labels(model).set(1 if panic else 0)

    async def _probe(self, base_url: str) -> bool:
        try:
            async with self._session.get(base_url.rstrip("/") + "/health", timeout=self._timeout) as response:
                await response.read()
                return response.status == 200
        except (aiohttp.ClientError, TimeoutError):
            return False
