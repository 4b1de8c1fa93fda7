"""Every policy and metric name, in one place, with the factory that builds it from the settings.

Adding a policy is one module (a factory taking settings, rng and the built metrics, validating its
own parameters) plus one line in POLICIES; a metric, one class plus one line in METRICS. The
settings model stores names as plain strings; `check_settings` (run by the commands at start-up
and by every Scheduler) rejects an unknown name or a bad parameter with ConfigError naming the flag.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping

from kvgate.config.loader import ConfigError
from kvgate.config.settings import Settings
from kvgate.scheduler.conductor import PredictedTTFT, make_conductor
from kvgate.scheduler.policies import (
    Policy,
    make_cache_aware,
    make_least_load,
    make_prefix,
    make_round_robin,
)
from kvgate.scheduler.scheduling_metrics import (
    CacheAwareAllPrefillsTokensNum,
    KvCacheHitLen,
    LoadMetric,
    SchedulingMetric,
)

PolicyFactory = Callable[[Settings, random.Random | None, Mapping[str, SchedulingMetric]], Policy]
MetricFactory = Callable[[Settings], SchedulingMetric]

POLICIES: dict[str, PolicyFactory] = {
    "round_robin": make_round_robin,
    "least_load": make_least_load,
    "prefix": make_prefix,
    "cache_aware": make_cache_aware,
    "conductor": make_conductor,
}

METRICS: dict[str, MetricFactory] = {
    "all_prefills_tokens_num": lambda s: LoadMetric("all_prefills_tokens_num"),
    "num_waiting_requests": lambda s: LoadMetric("num_waiting_requests"),
    "num_requests": lambda s: LoadMetric("num_requests"),
    "kv_cache_usage_ratio": lambda s: LoadMetric("kv_cache_usage_ratio"),
    "kv_cache_hit_len": lambda s: KvCacheHitLen(),
    "cache_aware_all_prefills_tokens_num": lambda s: CacheAwareAllPrefillsTokensNum(
        s.cache_aware_queued_tokens_weight
    ),
    "predicted_ttft_s": lambda s: PredictedTTFT(),
}

POLICY_NAMES = tuple(POLICIES)
# ConfigError messages start as the loader's do.
_HEADER = "configuration error:\n  "


def build_metrics(settings: Settings) -> dict[str, SchedulingMetric]:
    unknown = [name for name in settings.dispatch_metric_order if name not in METRICS]
    if unknown:
        raise ConfigError(
            f"{_HEADER}invalid value for --dispatch-metric-order: unknown metric(s) {unknown}; "
            f"choose from {list(METRICS)}"
        )
    try:
        return {name: make(settings) for name, make in METRICS.items()}
    except ValueError as exc:
        raise ConfigError(f"{_HEADER}invalid scheduling metric parameter: {exc}") from None


def make_policy(settings: Settings, rng: random.Random | None = None) -> Policy:
    name = settings.effective_policy
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError(
            f"{_HEADER}invalid value for --dispatch-policy: {name!r}: choose from {', '.join(POLICIES)}"
        )
    return factory(settings, rng, build_metrics(settings))


def check_settings(settings: Settings) -> None:
    """Raise ConfigError (naming the flag) if the scheduling settings cannot build a policy."""
    make_policy(settings)
