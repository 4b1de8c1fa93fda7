"""Closes the TTFT model's loop on the live path: dispatches push the instance's queue clock,
first bytes calibrate it, and Prometheus sees the prediction error and the calibrated figures.

The forwarder calls `dispatched` when an attempt is sent and `first_byte` when its first byte is
relayed; a measured TTFT here is first byte minus dispatch (what the model predicts: queue,
prefill and transfer on that instance), not minus arrival.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.gateway.planning.routing import RoutePlan
from kvgate.metrics.computed import ComputedGauges
from kvgate.metrics.definitions import TTFTMetrics
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import TTFTPrediction


class TTFTFeedback:
    def __init__(
        self, scheduler: Scheduler, metrics: TTFTMetrics, computed: ComputedGauges,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._scheduler = scheduler
        self._metrics = metrics
        self._computed = computed
        self._clock = clock
        self._exported: set[str] = set()

    def dispatched(self, plan: RoutePlan, instance_id: str, max_tokens: int | None) -> Callable[[], None]:
        """Record the dispatch; returns what to call at the attempt's first byte."""
        now = self._clock()
        prediction = self._scheduler.observe_dispatch(plan.decision, instance_id, plan.num_prompt_tokens, max_tokens)
        if prediction is None:
            return _nothing
        return lambda: self._first_byte(prediction, now)

    def _first_byte(self, prediction: TTFTPrediction, dispatched_at: float) -> None:
        error = self._scheduler.observe_ttft(prediction, self._clock() - dispatched_at)
        self._metrics.prediction_error_seconds.observe(error)
        if prediction.instance_id not in self._exported:
            self._export(prediction.instance_id)

    def _export(self, instance_id: str) -> None:
        calibration = self._scheduler.ttft.calibration
        factor = self._metrics.calibration_factor
        self._computed.bind(factor.labels(instance_id, "compute"), lambda: calibration.factors(instance_id)[0])
        self._computed.bind(factor.labels(instance_id, "transfer"), lambda: calibration.factors(instance_id)[1])
        self._computed.bind(self._metrics.calibration_observations.labels(instance_id),
                            lambda: calibration.observations(instance_id))
        self._exported.add(instance_id)


def _nothing() -> None:
    return None
