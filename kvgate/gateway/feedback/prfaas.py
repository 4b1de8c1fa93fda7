"""The gateway's side of Prefill-as-a-Service (docs/PRFAAS.md): what the cluster rule learns from
the requests it routed, and what Prometheus shows of it.

The rule itself (scheduler/prfaas.py) runs inside `Scheduler.decide_pd`. The link estimate needs
the bytes that crossed: a pair whose decision puts KV on the PrfaaS -> local link records them when
the decode instance's first byte arrives, the moment the KV has certainly arrived (a try that fails
before it moved nothing the decode could use, and its retry is counted once).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvgate.metrics.computed import ComputedGauges
from kvgate.metrics.definitions import PrfaasMetrics
from kvgate.scheduler.prfaas import ClusterDecision, PrfaasRouter


class PrfaasLink:
    def __init__(self, router: PrfaasRouter, metrics: PrfaasMetrics, computed: ComputedGauges,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._router = router
        self._metrics = metrics
        self._clock = clock
        computed.bind(metrics.egress_gbps, lambda: router.egress_gbps(clock()))
        computed.bind(metrics.link_utilisation, lambda: router.link.utilisation(clock()))
        computed.bind(metrics.threshold_tokens, lambda: router.controller.threshold)
        computed.bind(metrics.offload_fraction, lambda: router.offload_fraction(clock()))

    def dispatched(self, decision: ClusterDecision) -> None:
        self._metrics.decisions.labels(decision.cluster).inc()

    def kv_crossed(self, decision: ClusterDecision) -> None:
        if decision.egress_bytes > 0:
            self._router.record_egress(self._clock(), decision.egress_bytes)
            self._metrics.egress_bytes.inc(decision.egress_bytes)

    def describe(self) -> dict[str, float | int | str]:
        """The rule's running state, for /debug/schedule."""
        now = self._clock()
        return {
            "egress_gbps": round(self._router.egress_gbps(now), 6),
            "link_utilisation": round(self._router.link.utilisation(now), 6),
            "threshold_tokens": self._router.controller.threshold,
            "threshold_last_change": self._router.controller.last_change,
            "offload_fraction": round(self._router.offload_fraction(now), 6),
        }
