"""The decode half of a prefill/decode (PD) decision.

A decode instance is chosen by decode load, never by prefix: its KV arrives from the prefill
instance. Metrics, compared in order by the shared Selector (first strict difference decides):

- predicted_decode_tokens: tokens still to be generated there by the requests the gateway sent
  (each counts its `max_tokens` until its stream ends), the work the new request queues behind;
- kv_cache_usage_ratio: the engine's KV usage, so a nearly full instance does not preempt;
- num_requests: the running batch (engine report merged with the account).

`DecodeLedger` holds the predicted tokens per instance; the gateway (and the simulator) add an
entry when a decode starts and remove it when it ends, on every path.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kvgate.scheduler.prfaas import ClusterDecision
from kvgate.scheduler.scheduling_metrics import LoadMetric, SchedulingMetric
from kvgate.scheduler.selector import Selector
from kvgate.scheduler.types import Candidate, Decision, RoutingRequest

DECODE_METRIC_ORDER = ("predicted_decode_tokens", "kv_cache_usage_ratio", "num_requests")


@dataclass(frozen=True, slots=True)
class PDDecision:
    """Both halves of a disaggregated request. Retries walk each ranking on its own."""

    prefill: Decision
    decode: Decision
    # The uncached part on the chosen decode instance is short: it prefills the prompt itself.
    skip_prefill: bool
    # Prompt tokens the chosen decode instance would compute itself (what the skip rule compares).
    decode_miss_tokens: int
    # Which cluster prefills and why, for a model with a Prefill-as-a-Service cluster (scheduler/prfaas.py).
    cluster: ClusterDecision | None = None


class PredictedDecodeTokens(SchedulingMetric):
    name = "predicted_decode_tokens"

    def __init__(self, tokens: Mapping[str, int]) -> None:
        self._tokens = tokens

    def values(self, candidates: Sequence[Candidate], request: RoutingRequest) -> list[float]:
        return [self._tokens.get(candidate.id, 0) for candidate in candidates]


class DecodeLedger:
    """Predicted decode tokens per instance, by request key. Release is idempotent."""

    def __init__(self) -> None:
        self._entries: dict[str, tuple[str, int]] = {}
        self._per_instance: dict[str, int] = {}

    def add(self, key: str, instance_id: str, max_tokens: int) -> None:
        self.release(key)
        self._entries[key] = (instance_id, max_tokens)
        self._per_instance[instance_id] = self._per_instance.get(instance_id, 0) + max_tokens

    def release(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is None:
            return
        instance_id, tokens = entry
        left = self._per_instance[instance_id] - tokens
        if left:
            self._per_instance[instance_id] = left
        else:
            del self._per_instance[instance_id]

    @property
    def tokens(self) -> Mapping[str, int]:
        return self._per_instance

    def __len__(self) -> int:
        return len(self._entries)


class DecodeChooser:
    def __init__(self, selector: Selector | None = None) -> None:
        # A selector of its own: its tie cursor must rotate over decode instances, not prefill ones.
        self._selector = selector or Selector()
        self._load_metrics = [LoadMetric(name) for name in DECODE_METRIC_ORDER[1:]]

    def choose(
        self, request: RoutingRequest, candidates: Sequence[Candidate], predicted_tokens: Mapping[str, int]
    ) -> Decision:
        metrics = [PredictedDecodeTokens(predicted_tokens), *self._load_metrics]
        return self._selector.select(metrics, candidates, request, cache_aware=False)
