"""What an engine's answer teaches the gateway, whichever front door saw it go by.

Both front doors (the OpenAI HTTP server's forwarder and the Envoy endpoint picker, gateway/ext_proc/)
report the same events of one attempt here, so the loop closes the same way on either: the dispatch
and its first byte in the load account and the TTFT model, the prefix hit the plan predicted against
the one the engine reports in its usage (hit_accounting.py), and each attempt's outcome for passive
outlier detection (outliers.py). The caller owns the account entry's key and releases it on every path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvgate.gateway.feedback.hit_accounting import HitAccounting
from kvgate.gateway.feedback.ttft import TTFTFeedback
from kvgate.gateway.feedback.usage import UsageTap
from kvgate.gateway.fleet.inflight import InflightTracker
from kvgate.gateway.fleet.outliers import OutlierDetector
from kvgate.gateway.log_throttle import LogThrottle
from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import ParsedRequest
from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.selector import ScoreTable

log = logging.getLogger(__name__)


class DispatchFeedback:
    def __init__(
        self,
        tracker: InflightTracker,
        metrics: GatewayMetrics,
        outliers: OutlierDetector,
        hits: HitAccounting | None = None,
        ttft_feedback: TTFTFeedback | None = None,
    ) -> None:
        self.tracker = tracker
        self.outliers = outliers
        self.hits = hits
        self._metrics = metrics
        self._ttft_feedback = ttft_feedback
        self._refusals = LogThrottle(log)

    def compares(self, parsed: ParsedRequest, plan: RoutePlan) -> bool:
        """Whether this request's answer is read for its usage (hit accounting is on and can judge it)."""
        return self.hits is not None and comparable(parsed, plan)

    def first_byte(self, key: str, arrived: float, on_first_byte: Callable[[], None] | None) -> None:
        """The attempt's first byte reached the client: its prefill is done (account, TTFT model, metric)."""
        self.tracker.first_token(key)
        if on_first_byte is not None:
            on_first_byte()
        self._metrics.ttft_seconds.observe(time.perf_counter() - arrived)

    def ttft_dispatched(self, plan: RoutePlan, instance_id: str, max_tokens: int | None) -> Callable[[], None]:
        """Tell the TTFT model an attempt left for `instance_id`; returns what to call when the
        instance's prefill is done (its first byte), which calibrates the model."""
        if self._ttft_feedback is None:
            return lambda: None
        return self._ttft_feedback.dispatched(plan, instance_id, max_tokens)

    def observe_hit_ratio(self, plan: RoutePlan, instance_id: str) -> None:
        score = plan.score(instance_id)
        if score is not None and plan.num_prompt_tokens:
            self._metrics.prefix_hit_ratio.observe(score.prefix_hit_tokens / plan.num_prompt_tokens)

    def record_prefill_hit(self, parsed: ParsedRequest, plan: RoutePlan, instance_id: str, answer: bytes,
                           request_id: str) -> None:
        """A disaggregated request: the prefill instance's JSON answer reports what it found cached."""
        if not self.compares(parsed, plan):
            return
        tap = UsageTap(strip_usage_chunk=False)
        tap.whole(answer)
        self.record_hit(plan, instance_id, tap, request_id)

    def record_hit(self, plan: RoutePlan, instance_id: str, tap: UsageTap, request_id: str) -> None:
        assert self.hits is not None
        if tap.usage is None and not tap.answered:  # a relayed 4xx, a stream cut short: no word
            return
        if tap.usage is not None and tap.usage.refused:
            self._refused_usage(instance_id, tap.usage.refused, request_id)
        score = plan.score(instance_id)
        predicted = score.prefix_hit_tokens if score is not None else 0
        self.hits.record(instance_id, predicted, _longest_prefix_hit(plan), tap.usage, request_id)

    def _refused_usage(self, instance_id: str, fields: tuple[str, ...], request_id: str) -> None:
        for name in fields:
            self._metrics.engine_values_refused.labels(name).inc()
        self._refusals.warning("instance %s reported impossible usage numbers (%s), refused or clamped; "
                               "request %s", instance_id, ", ".join(fields), request_id)


def comparable(parsed: ParsedRequest, plan: RoutePlan) -> bool:
    """Whether the answer's usage can check the prediction: the store answered (or, with no store,
    the engines' KV events did), and the usage is of that one prompt (a batch or n > 1 reports its
    prompts' or samples' sums). Other requests are relayed untouched and unread."""
    evidence = plan.kvs_status == "ok" or (plan.kvs_status == "skipped" and plan.engine_hits is not None)
    return evidence and parsed.batch is None and parsed.body.get("n") in (1, None)


def _longest_prefix_hit(plan: RoutePlan) -> int:
    """The longest prefix the store held on any candidate."""
    scores = plan.decision.scores
    if isinstance(scores, ScoreTable):
        return scores.longest_prefix_hit()  # without building every candidate's score
    return max((score.prefix_hit_tokens for score in scores), default=0)
