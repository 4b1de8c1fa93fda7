"""The policy interface and the Llumnix-style policies (`--dispatch-policy`, REFERENCE.md section 4).

Every policy here is an ordered list of metrics handed to the selector; they differ only in which
metric, if any, goes in front of the configured load order:

- round_robin: none at all, so every candidate ties and the selector's cursor rotates over them.
- least_load: the load metrics in `--dispatch-metric-order`.
- prefix: the longest prefix hit first (kv_cache_hit_len), then load.
- cache_aware: cache_aware_all_prefills_tokens_num first (prefix miss + weighted queued prefill,
  `--cache-aware-queued-tokens-weight`), then load.

The cache metric is used only for prompts of at least `--cache-aware-scheduling-min-tokens` and for
candidate sets with a prefill or neutral instance: a decode instance's prefix does not matter.
Policies are registered by name in registry.py (conductor has its own module, conductor.py).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvgate.config.settings import InstanceRole, Settings
from kvgate.scheduler.scheduling_metrics import SchedulingMetric
from kvgate.scheduler.selector import Selector
from kvgate.scheduler.types import Candidate, Decision, RoutingRequest


class Policy(Protocol):
    name: str
    # Whether the policy ranks on TTFT predictions (the scheduler then attaches them to requests).
    needs_predictions: bool

    def uses_cache(self, num_prompt_tokens: int) -> bool:
        """Whether prefix hits may matter for a prompt this long (so the store is worth asking)."""
        ...

    def select(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision: ...


class MetricPolicy:
    """Ranks on `load_metrics`, with `cache_metric` in front when the request qualifies."""

    needs_predictions = False

    def __init__(
        self,
        name: str,
        load_metrics: Sequence[SchedulingMetric],
        cache_metric: SchedulingMetric | None,
        cache_min_tokens: int,
        selector: Selector,
    ) -> None:
        self.name = name
        self._load_metrics = list(load_metrics)
        self._cache_metrics = (
            [cache_metric, *(m for m in load_metrics if m.name != cache_metric.name)]
            if cache_metric is not None
            else self._load_metrics
        )
        self._uses_cache = cache_metric is not None
        self._cache_min_tokens = cache_min_tokens
        self._selector = selector

    def uses_cache(self, num_prompt_tokens: int) -> bool:
        return self._uses_cache and num_prompt_tokens >= self._cache_min_tokens

    def select(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        cache_aware = self.uses_cache(request.num_prompt_tokens) and any(
            c.role != InstanceRole.DECODE for c in candidates
        )
        metrics: Sequence[SchedulingMetric] = self._cache_metrics if cache_aware else self._load_metrics
        return self._selector.select(metrics, candidates, request, cache_aware)


# --- factories: (settings, rng, the registry's metrics built from the settings) -> policy ---


def _metric_policy(name: str, cache_metric: str | None):
    def make(settings: Settings, rng: random.Random | None, metrics: Mapping[str, SchedulingMetric]) -> MetricPolicy:
        order = [metrics[m] for m in settings.dispatch_metric_order]
        return MetricPolicy(
            name,
            order,
            metrics[cache_metric] if cache_metric else None,
            settings.cache_aware_scheduling_min_tokens,
            Selector(settings.dispatch_top_k, rng),
        )

    return make


def make_round_robin(
    settings: Settings, rng: random.Random | None, metrics: Mapping[str, SchedulingMetric]
) -> MetricPolicy:
    # top_k does not apply: the rotation itself spreads the load.
    return MetricPolicy("round_robin", (), None, settings.cache_aware_scheduling_min_tokens, Selector(1, rng))


make_least_load = _metric_policy("least_load", None)
make_prefix = _metric_policy("prefix", "kv_cache_hit_len")
make_cache_aware = _metric_policy("cache_aware", "cache_aware_all_prefills_tokens_num")
