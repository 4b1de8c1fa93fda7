"""/metrics for a gateway of several workers: every worker's samples, and the shared state once.

Counters and histograms are prometheus-client's multiprocess files, merged (every metric any room
defines, without listing them here). The gauges that describe shared state (what is in flight per
instance, which instances are healthy) are read from the shared table by whichever worker answers,
rather than one possibly stale copy per worker.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector

from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.workers.shared_rows import SharedRows

_FROM_SHARED_STATE = {
    "kvgate_inflight_requests": "Requests dispatched to an instance and not yet finished.",
    "kvgate_inflight_prefill_tokens": "Uncomputed prompt tokens dispatched to an instance awaiting first token.",
    "kvgate_instance_healthy": "1 while the instance passes health checks, 0 while ejected.",
}


class _WholeGateway:
    def __init__(self, metrics_dir: str, rows: SharedRows, registry: InstanceRegistry) -> None:
        self._metrics_dir = metrics_dir
        self._rows = rows
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in MultiProcessCollector(None, self._metrics_dir).collect():
            if family.name not in _FROM_SHARED_STATE:
                yield family
        families = {name: GaugeMetricFamily(name, doc, labels=["instance"]) for name, doc in _FROM_SHARED_STATE.items()}
        for state in self._registry.states():
            requests, _, tokens = self._rows.summed(state.id)
            families["kvgate_inflight_requests"].add_metric([state.id], requests)
            families["kvgate_inflight_prefill_tokens"].add_metric([state.id], tokens)
            families["kvgate_instance_healthy"].add_metric([state.id], 1 if state.healthy else 0)
        yield from families.values()


def whole_gateway_metrics(metrics_dir: str, rows: SharedRows, registry: InstanceRegistry) -> bytes:
    """Every worker's series (from their files in `metrics_dir`) and the in-flight and health gauges
    from the shared state."""
    collectors = CollectorRegistry()
    collectors.register(_WholeGateway(metrics_dir, rows, registry))  # type: ignore[arg-type]
    return generate_latest(collectors)
