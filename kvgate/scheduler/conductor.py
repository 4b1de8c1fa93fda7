"""Policy `conductor`: the smallest predicted TTFT wins (Mooncake Conductor, REFERENCE.md section 5).

The predicted TTFT (ttft.py) counts the queue, the prefill left after the best usable prefix and
the transfer of that prefix from other segments or disk tiers, so a prefix held elsewhere in the
pool is worth its transfer cost, not nothing (Llumnix) and not everything. Load metrics in
`--dispatch-metric-order` then break ties, and the selector's rotating cursor after them.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from kvgate.config.settings import InstanceRole, Settings
from kvgate.scheduler.scheduling_metrics import SchedulingMetric
from kvgate.scheduler.selector import Selector
from kvgate.scheduler.types import Candidate, Decision, RoutingRequest


class PredictedTTFT(SchedulingMetric):
    """The candidate's predicted TTFT in seconds (0 where the request carries no predictions)."""

    name = "predicted_ttft_s"

    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        predictions = request.predictions
        if predictions is None:
            return [0.0] * len(candidates)
        return [predictions[candidate.id].predicted_ttft_s for candidate in candidates]


class ConductorPolicy:
    name = "conductor"
    needs_predictions = True

    def __init__(
        self, load_metrics: Sequence[SchedulingMetric], cache_min_tokens: int, selector: Selector
    ) -> None:
        self._metrics = [PredictedTTFT(), *(m for m in load_metrics if m.name != PredictedTTFT.name)]
        self._load_metrics = list(load_metrics)
        self._cache_min_tokens = cache_min_tokens
        self._selector = selector

    def uses_cache(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens >= self._cache_min_tokens

    def select(self, request: RoutingRequest, candidates: Sequence[Candidate]) -> Decision:
        # A decode instance's TTFT does not matter: a decode-only candidate set goes on load.
        prefill = any(c.role != InstanceRole.DECODE for c in candidates)
        metrics = self._metrics if prefill else self._load_metrics
        return self._selector.select(metrics, candidates, request, self.uses_cache(request.num_prompt_tokens))


def make_conductor(
    settings: Settings, rng: random.Random | None, metrics: Mapping[str, SchedulingMetric]
) -> ConductorPolicy:
    # --kvcache-balancing-threshold belongs to the TTFT model every policy shares (settings check it).
    order = [metrics[name] for name in settings.dispatch_metric_order]
    return ConductorPolicy(order, settings.cache_aware_scheduling_min_tokens,
                           Selector(settings.dispatch_top_k, rng))
