"""A mock engine's /metrics, under vLLM v1's names so scrapers built for vLLM read it unchanged.

Gauges and counters are read from the engine core when scraped (one source of truth); only the
TTFT histogram is observed by the server as first tokens go out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvgate.engine_model import CoreStats

# vLLM's own TTFT buckets (seconds).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)


# SGLang's names for the gauges a scraper reads (REFERENCE.md section 8), by vLLM name.
_SGLANG_NAMES = {
    "vllm:num_requests_running": "sglang:num_running_reqs",
    "vllm:num_requests_waiting": "sglang:num_queue_reqs",
    "vllm:kv_cache_usage_perc": "sglang:token_usage",
    "vllm:time_to_first_token_seconds": "sglang:time_to_first_token_seconds",
}


class _CoreStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], CoreStats], flavour: str = "vllm") -> None:
        self._model_name = model_name
        self._stats = stats
        self._names = _SGLANG_NAMES if flavour == "sglang" else {}

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        label = [self._model_name]
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                stats.num_running,
            ),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                stats.kv_cache_usage_ratio,
            ),
        )
        for name, documentation, value in gauges:
            family = GaugeMetricFamily(self._names.get(name, name), documentation, labels=["model_name"])
            family.add_metric(label, value)
            yield family
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                stats.prefix_cache_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                stats.prefix_cache_hits,
            ),
        )
        for name, documentation, value in counters:
            family = CounterMetricFamily(name, documentation, labels=["model_name"])
            family.add_metric(label, value)
            yield family


class EngineMetrics:
    """The registry one mock engine serves, plus the TTFT histogram its handlers observe."""

    def __init__(self, model_name: str, stats: Callable[[], CoreStats], flavour: str = "vllm") -> None:
        """`flavour` "sglang" exports SGLang's names for the gauges and the TTFT histogram."""
        self.registry = CollectorRegistry()
        self.registry.register(_CoreStatsCollector(model_name, stats, flavour))
        ttft_name = "vllm:time_to_first_token_seconds"
        self._ttft = Histogram(
            _SGLANG_NAMES[ttft_name] if flavour == "sglang" else ttft_name,
            "Histogram of time to first token in seconds.",
            ["model_name"],
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)

    def observe_ttft(self, seconds: float) -> None:
        self._ttft.observe(seconds)
