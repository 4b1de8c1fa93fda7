"""Online calibration of the TTFT model, per instance: bounded and robust to outliers.

Each instance has two factors, one for compute (queue + prefill) and one for transfer, starting
at 1. A measured TTFT (first byte minus dispatch) against the terms predicted for it moves both in
log space, each in proportion to its share of the prediction:

    log f += RATE * share * clip(log(measured / predicted), -STEP, +STEP)

The clip makes one outlier (a GC pause, a retried connection) move a factor by at most
exp(RATE * STEP) ~ 7%, and the factors stay within [MIN_FACTOR, MAX_FACTOR]: a wrong profile is
corrected up to 8x either way, a broken measurement never drives predictions to zero or infinity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

RATE = 0.1
STEP = math.log(2.0)
MIN_FACTOR, MAX_FACTOR = 0.125, 8.0
_LOG_MIN, _LOG_MAX = math.log(MIN_FACTOR), math.log(MAX_FACTOR)
# Predictions shorter than this say nothing about the profile (scheduling noise dominates).
_MIN_PREDICTED_S = 1e-4


@dataclass(slots=True)
class _Factors:
    log_compute: float = 0.0
    log_transfer: float = 0.0
    observations: int = 0


class Calibration:
    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._factors: dict[str, _Factors] = {}

    def factors(self, instance_id: str) -> tuple[float, float]:
        """(compute factor, transfer factor) of the instance; (1, 1) until it has been measured."""
        factors = self._factors.get(instance_id)
        if factors is None:
            return 1.0, 1.0
        return math.exp(factors.log_compute), math.exp(factors.log_transfer)

    def observations(self, instance_id: str) -> int:
        factors = self._factors.get(instance_id)
        return factors.observations if factors else 0

    def observe(self, instance_id: str, compute_s: float, transfer_s: float, measured_s: float) -> None:
        """`compute_s`, `transfer_s`: the uncalibrated terms predicted for a request that took `measured_s`."""
        if not self.enabled or measured_s <= 0 or not math.isfinite(measured_s):
            return
        factors = self._factors.get(instance_id)
        if factors is None:
            factors = self._factors[instance_id] = _Factors()
        compute = math.exp(factors.log_compute) * compute_s
        transfer = math.exp(factors.log_transfer) * transfer_s
        predicted = compute + transfer
        if predicted < _MIN_PREDICTED_S:
            return
        error = max(-STEP, min(STEP, math.log(measured_s / predicted)))
        factors.log_compute = _bounded(factors.log_compute + RATE * (compute / predicted) * error)
        factors.log_transfer = _bounded(factors.log_transfer + RATE * (transfer / predicted) * error)
        factors.observations += 1

    def forget(self, instance_id: str) -> None:
        self._factors.pop(instance_id, None)


def _bounded(log_factor: float) -> float:
    return max(_LOG_MIN, min(_LOG_MAX, log_factor))
