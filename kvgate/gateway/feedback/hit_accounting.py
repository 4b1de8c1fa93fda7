"""Closed-loop hit accounting: the prefix hit the gateway predicted against the one the engine reports.

A router whose tokens or block keys differ from the engine's (another tokenizer or chat template, a
different hash seed, algorithm, chunk size or key format) finds nothing in the store, and routing
quietly degrades to load balancing. Engines report the truth in `usage.prompt_tokens_details.cached_tokens`,
so every answer is compared with the prediction made when the request was routed:

- per instance, counters of predicted and reported cached tokens, their absolute disagreement and
  each comparison's outcome (metrics/definitions.py, `HitMetrics`);
- a warning, at most one per instance and cause every `log_interval_s`, when the pattern over the
  recent requests names a likely cause: the engine reports hits while the store held none of the
  gateway's keys anywhere (the keys differ), the store holds blocks on the instance the engine never
  reuses (the store claims blocks the engine does not use), or the engine reports no cached tokens.

Engines cache whole blocks and may recompute the last one, so a difference under one chunk agrees.
vLLM leaves `prompt_tokens_details` out when nothing was cached (even with
--enable-prompt-tokens-details), so once an instance has reported cached tokens, an answer without
them counts as 0; before that, it is `unreported`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.gateway.feedback.usage import ReportedUsage
from kvgate.metrics.children import Children
from kvgate.metrics.definitions import HitMetrics

log = logging.getLogger(__name__)

# A cause is named only after this many requests show it, so one publication lag is not a finding.
MIN_EVIDENCE = 3
# Requests after which a window without any finding starts afresh ("always zero" means recently).
WINDOW_REQUESTS = 200
LOG_INTERVAL_S = 60.0

KEYS_DIFFER = "keys_differ"
STORE_CLAIMS = "store_claims_unused_blocks"
UNREPORTED = "cached_tokens_unreported"

_CAUSES = {
    KEYS_DIFFER: (
        "the engine reported {reported} cached prompt tokens over {requests} requests but the store held "
        "none of the gateway's block keys on any instance: the gateway's keys differ from the engine's "
        "(tokenizer or chat template, hash_seed vs the engine's PYTHONHASHSEED, kvs_hash_algo, "
        "kvs_chunk_size vs the engine's block size, kvs_key_format or kvs_model_name); "
        "run `kvgate doctor --config <file>`"
    ),
    STORE_CLAIMS: (
        "the store listed {predicted} prompt tokens of blocks on this instance over {requests} requests but "
        "the engine reused none: kvs_endpoints may map another host to this instance, or the engine does "
        "not load blocks from the store"
    ),
    UNREPORTED: (
        "the engine answered {requests} requests for which the store held cached blocks without "
        "usage.prompt_tokens_details.cached_tokens, so hits cannot be checked: start vLLM with "
        "--enable-prompt-tokens-details, SGLang with --enable-cache-report"
    ),
}


@dataclass(slots=True)
class _Window:
    """What one instance's recent comparisons showed."""

    requests: int = 0
    reported: int = 0  # cached tokens the engine reported
    with_reported_hit: int = 0
    found_anywhere: int = 0  # prefix tokens the store held on any instance
    predicted: int = 0  # prefix tokens the store held on this instance
    with_predicted_hit: int = 0
    unreported: int = 0
    unreported_with_predicted_hit: int = 0


class HitAccounting:
    def __init__(
        self,
        metrics: HitMetrics,
        chunk_size: int,
        *,
        min_evidence: int = MIN_EVIDENCE,
        log_interval_s: float = LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._chunk_size = chunk_size
        self._min_evidence = min_evidence
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._windows: dict[str, _Window] = {}
        self._predicted = Children(metrics.predicted_tokens)
        self._reported = Children(metrics.reported_tokens)
        self._disagreement = Children(metrics.disagreement_tokens)
        self._comparisons = Children(metrics.comparisons)
        self._last_logged: dict[tuple[str, str], float] = {}
        self._reporting: set[str] = set()  # instances that have reported cached tokens at least once

    def record(
        self, instance_id: str, predicted: int, found_anywhere: int, usage: ReportedUsage | None, request_id: str
    ) -> None:
        """One answered request: `predicted` prefix tokens held on the instance that answered,
        `found_anywhere` the longest prefix held on any instance, `usage` what the engine reported."""
        window = self._windows.get(instance_id)
        if window is None:
            window = self._windows[instance_id] = _Window()
        window.requests += 1
        reported = usage.cached_tokens if usage is not None else None
        if reported is None and usage is not None and instance_id in self._reporting:
            reported = 0  # vLLM omits a zero
        if reported is None:
            self._comparisons(instance_id, "unreported").inc()
            window.unreported += 1
            window.unreported_with_predicted_hit += predicted > 0
        else:
            self._reporting.add(instance_id)
            self._predicted(instance_id).inc(predicted)
            self._reported(instance_id).inc(reported)
            self._disagreement(instance_id).inc(abs(reported - predicted))
            self._comparisons(instance_id, self._outcome(predicted, reported)).inc()
            window.reported += reported
            window.with_reported_hit += reported > 0
            window.found_anywhere += found_anywhere
            window.predicted += predicted
            window.with_predicted_hit += predicted > 0
        self._judge(instance_id, window, request_id)

    def _outcome(self, predicted: int, reported: int) -> str:
        if abs(reported - predicted) < self._chunk_size:
            return "agree"
        return "engine_higher" if reported > predicted else "gateway_higher"

    def _judge(self, instance_id: str, window: _Window, request_id: str) -> None:
        found = None
        if window.with_reported_hit >= self._min_evidence and window.found_anywhere == 0:
            found = KEYS_DIFFER
        elif window.with_predicted_hit >= self._min_evidence and window.reported == 0:
            found = STORE_CLAIMS
        elif window.unreported_with_predicted_hit >= self._min_evidence and window.unreported == window.requests:
            # Hits were predicted, yet not one answer said how much was cached.
            found = UNREPORTED
        if found is None:
            if window.requests >= WINDOW_REQUESTS:
                self._windows[instance_id] = _Window()
            return
        self._windows[instance_id] = _Window()
        now = self._clock()
        last = self._last_logged.get((instance_id, found))
        if last is not None and now - last < self._log_interval_s:
            return
        self._last_logged[(instance_id, found)] = now
        message = _CAUSES[found].format(reported=window.reported, predicted=window.predicted,
                                        requests=window.requests)
        log.warning("hit accounting: instance %s: %s (%s; last request %s)", instance_id, message, found,
                    request_id)
