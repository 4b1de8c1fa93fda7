"""The PD replay with a remote Prefill-as-a-Service cluster behind a link of limited bandwidth.

The fleet: P local prefill and D local decode instances, and N prefill instances in the PrfaaS
cluster (`--prfaas-cluster`). Every arrival takes the gateway's decision, `Scheduler.decide_pd`,
whose cluster rule (scheduler/prfaas.py) picks the cluster that prefills it. The KV of a prompt
prefilled remotely crosses the link (`--prfaas-egress-gbps`, sized by `--prfaas-kv-bytes-per-token`
or `--prfaas-kv-size-mib`) before it reaches its decode instance: transfers queue on the link one
after another, so a saturated link shows up as TTFT. Prefixes the abundant mode ships take their
place on the same queue (the request itself does not wait for them: its prefill instance loads the
prefix through the store, which is priced as any store load). The rule learns the link's use from
`record_egress` as the gateway's does; local hand-offs go over the fast in-cluster interconnect.

`naive=True` replaces the rule by the naive one the paper compares with: every prompt longer than
the threshold is prefilled remotely, whatever is cached, at a fixed threshold.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.config.settings import PrfaasBandwidthMode, Settings
from kvgate.engine_model import ServiceProfile
from kvgate.scheduler.decode import PDDecision
from kvgate.scheduler.prfaas import PrfaasRouter
from kvgate.simulator.pd_replay import DEFAULT_KV_TRANSFER_TOKENS_PER_S, PDReplay
from kvgate.simulator.replay import SimInstance, SimulationResult
from kvgate.simulator.trace import TraceRequest


@dataclass(frozen=True)
class LinkOutcome:
    """What crossed the PrfaaS -> local link during a replay."""

    egress_bytes: int
    busy_s: float  # time the link spent carrying bytes
    offloaded: int  # requests prefilled in the PrfaaS cluster
    decided: int  # requests that took a cluster decision
    final_threshold_tokens: int

    def utilisation(self, makespan_s: float) -> float:
        return self.busy_s / makespan_s if makespan_s > 0 else 0.0

    def egress_gbps(self, makespan_s: float) -> float:
        return self.egress_bytes * 8 / 1e9 / makespan_s if makespan_s > 0 else 0.0


@dataclass(frozen=True)
class PrfaasResult:
    result: SimulationResult
    link: LinkOutcome


class PrfaasReplay(PDReplay):
    def __init__(
        self,
        requests: Sequence[TraceRequest],
        settings: Settings,
        num_prefill: int,
        num_decode: int,
        num_prfaas: int,
        profile: ServiceProfile,
        *,
        naive: bool = False,
        kv_transfer_tokens_per_s: float = DEFAULT_KV_TRANSFER_TOKENS_PER_S,
        seed: int = 0,
        show_progress: bool = False,
        store_model: str = "shared",
    ) -> None:
        if not settings.prfaas_cluster:
            raise ValueError("a PrfaaS replay needs --prfaas-cluster and its link (--prfaas-egress-gbps)")
        if num_prfaas < 1:
            raise ValueError("a PrfaaS replay needs at least one PrfaaS prefill instance")
        # The PD replay's prefill slots are 0..P+N-1; the last N of them are the PrfaaS cluster's.
        super().__init__(requests, settings, num_prefill + num_prfaas, num_decode, profile,
                         kv_transfer_tokens_per_s=kv_transfer_tokens_per_s, seed=seed,
                         show_progress=show_progress, store_model=store_model)
        for inst in self.instances[num_prefill:num_prefill + num_prfaas]:
            inst.config = inst.config.model_copy(update={"cluster": settings.prfaas_cluster})
        self.scheduler.set_instances([inst.config for inst in self.instances])
        if naive:
            fixed = settings.model_copy(update={
                "prfaas_bandwidth_mode": PrfaasBandwidthMode.SCARCE,
                "prfaas_threshold_min_tokens": settings.prfaas_threshold_tokens,
                "prfaas_threshold_max_tokens": settings.prfaas_threshold_tokens,
            })
            self.scheduler.prfaas = PrfaasRouter(fixed, judge_cached_prefix=False)
        router = self.scheduler.prfaas
        assert router is not None
        self.router = router
        self._link_bytes_per_s = settings.prfaas_egress_gbps * 1e9 / 8
        self._link_free_at = 0.0
        self._link_busy_s = 0.0
        self._egress_bytes = 0
        self._offloaded = 0
        self._decisions = 0

    def _decided(self, pd: PDDecision, now: float) -> None:
        cluster = pd.cluster
        if cluster is None:
            return
        self._decisions += 1
        self._offloaded += cluster.offloaded
        if not cluster.offloaded and cluster.egress_bytes:  # a prefix shipped from the PrfaaS cluster
            self._cross(cluster.egress_bytes, now)

    def _kv_arrives_at(self, prefill: SimInstance, i: int, now: float) -> float:
        if prefill.config.cluster != self.router.cluster:
            return super()._kv_arrives_at(prefill, i, now)
        return self._cross(self.router.kv_size.bytes(self._requests[i].input_length), now)

    def _cross(self, nbytes: int, now: float) -> float:
        """Queue `nbytes` on the link; returns when the last byte is across."""
        duration = nbytes / self._link_bytes_per_s
        self._link_free_at = max(now, self._link_free_at) + duration
        self._link_busy_s += duration
        self._egress_bytes += nbytes
        self.router.record_egress(now, nbytes)
        return self._link_free_at

    def run_prfaas(self) -> PrfaasResult:
        result = self.run()
        return PrfaasResult(result, LinkOutcome(self._egress_bytes, self._link_busy_s, self._offloaded,
                                                self._decisions, self.router.controller.threshold))
