"""One policy interface, four policies (`--dispatch-policy`, REFERENCE.md section 4).

Every policy is an ordered list of metrics handed to the selector; they differ only in which
metric, if any, goes in front of the configured load order:

- round_robin: none at all, so every candidate ties and the selector's cursor rotates over them.
- least_load: the load metrics in `--dispatch-metric-order`.
- prefix: the longest prefix hit first (kv_cache_hit_len), then load.
- cache_aware: cache_aware_all_prefills_tokens_num first (prefix miss + weighted queued prefill,
  `--cache-aware-queued-tokens-weight`), then load.

The cache metric is used only for prompts of at least `--cache-aware-scheduling-min-tokens` and for
candidate sets with a prefill or neutral instance: a decode instance's prefix does not matter.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Protocol

from kvgate.config.settings import DispatchPolicy, InstanceRole, Settings
from kvgate.scheduler.scheduling_metrics import METRICS, CacheAwareAllPrefillsTokensNum, SchedulingMetric
from kvgate.scheduler.selector import Selector
from kvgate.scheduler.types import Candidate, Decision, RoutingRequest


class Policy(Protocol):
    name: str

    def uses_cache(self, num_prompt_tokens: int) -> bool:
        """Whether prefix hits may matter for a prompt this long (so the store is worth asking)."""
        ...

    def select(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision: ...


class MetricPolicy:
    """Ranks on `load_metrics`, with `cache_metric` in front when the request qualifies."""

    def __init__(
        self,
        name: str,
        load_metrics: Sequence[str],
        cache_metric: str | None,
        cache_min_tokens: int,
        selector: Selector,
        metrics: Mapping[str, SchedulingMetric] = METRICS,
    ) -> None:
        self.name = name
        self._load_metrics = [metrics[m] for m in load_metrics]
        self._cache_metrics = (
            [metrics[cache_metric]] + [metrics[m] for m in load_metrics if m != cache_metric]
            if cache_metric
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


def make_policy(settings: Settings, rng: random.Random | None = None) -> Policy:
    policy = settings.effective_policy
    order = settings.dispatch_metric_order
    min_tokens = settings.cache_aware_scheduling_min_tokens
    if policy == DispatchPolicy.ROUND_ROBIN:
        # top_k does not apply: the rotation itself spreads the load.
        return MetricPolicy(policy.value, (), None, min_tokens, Selector(1, rng))
    selector = Selector(settings.dispatch_top_k, rng)
    cache_metric = {
        DispatchPolicy.LEAST_LOAD: None,
        DispatchPolicy.PREFIX: "kv_cache_hit_len",
        DispatchPolicy.CACHE_AWARE: "cache_aware_all_prefills_tokens_num",
    }[policy]
    metrics = {
        **METRICS,
        "cache_aware_all_prefills_tokens_num": CacheAwareAllPrefillsTokensNum(
            settings.cache_aware_queued_tokens_weight
        ),
    }
    return MetricPolicy(policy.value, order, cache_metric, min_tokens, selector, metrics)
