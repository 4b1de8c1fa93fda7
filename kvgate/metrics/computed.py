"""Gauges whose value is computed from state the gateway already holds, in one process or in workers.

One process exports such a figure (the tokenize cache's size, a calibration factor, the PrfaaS
threshold) with `Gauge.set_function`: the function runs at each scrape. A gateway of several workers
serves /metrics from prometheus-client's multiprocess files (kvgate/workers/whole_metrics.py), which
hold only values written with `set()`: a function is never called there and its gauge would read 0.
So a worker writes each function's value into its file every `COPY_INTERVAL_S` instead; how the
workers' values are merged is each gauge's `multiprocess_mode` (metrics/definitions.py).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import Gauge

# How stale a worker's computed gauges may be on /metrics (a scrape is usually every 15 s or more).
COPY_INTERVAL_S = 1.0


class _Bound:
    """A gauge, the function it reads, and the value last written into the worker's file."""

    __slots__ = ("gauge", "value", "written")

    def __init__(self, gauge: Gauge, value: Callable[[], float]) -> None:
        self.gauge = gauge
        self.value = value
        self.written: float | None = None

    def write(self) -> None:
        """Unchanged values are not rewritten, so a "mostrecent" gauge shows the worker whose figure
        moved last."""
        current = float(self.value())
        if current != self.written:
            self.gauge.set(current)
            self.written = current


class ComputedGauges:
    def __init__(self, into_files: bool) -> None:
        self._into_files = into_files  # a worker of several: values are copied, not computed at scrape
        self._bound: list[_Bound] = []

    @property
    def copying(self) -> bool:
        """True when `copy` must run periodically (see COPY_INTERVAL_S)."""
        return self._into_files

    def bind(self, gauge: Gauge, value: Callable[[], float]) -> None:
        """`gauge` (a child, if the gauge has labels) reads `value()`."""
        if not self._into_files:
            gauge.set_function(value)
            return
        bound = _Bound(gauge, value)
        self._bound.append(bound)
        bound.write()

    def copy(self) -> None:
        """Write every bound value that changed into this worker's file."""
        for bound in self._bound:
            bound.write()

    async def copy_job(self) -> None:
        self.copy()
