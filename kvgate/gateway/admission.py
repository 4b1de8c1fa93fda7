"""Early rejection (Mooncake-style): refuse at once what would miss the TTFT SLO anyway.

Kept deliberately simple: the predicted time to first token on the best-ranked instance is
(prefill tokens already queued there + this request's uncached tokens) / prefill throughput.
A request predicted over `--ttft-slo-s` gets 429 before it costs the fleet anything; a client
can retry later or elsewhere. Queueing in the engine and decode interference are ignored, so set
`--prefill-tokens-per-s` from a measured engine, a little below its peak.
"""

from __future__ import annotations

from kvgate.gateway.errors import APIError
from kvgate.gateway.routing import RoutePlan


def predicted_ttft_s(plan: RoutePlan, instance_id: str, prefill_tokens_per_s: float) -> float:
    queued = plan.queued_prefill_tokens(instance_id)
    return (queued + plan.miss_tokens(instance_id)) / prefill_tokens_per_s


def check_admission(plan: RoutePlan, ttft_slo_s: float, prefill_tokens_per_s: float) -> None:
    """Raise 429 when the best instance is predicted to miss the SLO; no-op when the SLO is 0 (off)."""
    selected = plan.decision.selected
    if ttft_slo_s <= 0 or selected is None:
        return
    predicted = predicted_ttft_s(plan, selected, prefill_tokens_per_s)
    if predicted > ttft_slo_s:
        raise APIError(
            429,
            f"overloaded: predicted time to first token {predicted:.2f}s exceeds the {ttft_slo_s:g}s SLO; "
            "retry later",
            code="ttft_slo_exceeded",
        )
