"""Prefill-as-a-Service routing: which cluster prefills a request, and how the threshold adapts.

A remote cluster of prefill-only instances (`--prfaas-cluster`) takes the prompts whose incremental
(uncached) length exceeds a threshold; the KV cache then crosses a link of limited bandwidth to a
local decode instance. Everything else uses local PD. Pure: the caller passes the clock, the cached
prefix each cluster holds for the request and the prefill queues, and reports the bytes it puts on
the link (`record_egress`), so the gateway and the simulator run the same rules.

- Scarce link: each cluster's cached prefix is judged on its own. The request stays local when what
  is left after the local prefix is within the threshold; otherwise it goes remote and reuses the
  remote prefix. Only the finished KV crosses the link.
- Abundant link: the longer cached prefix counts wherever it lies; if it lies in the other cluster
  than the one that prefills, it is shipped across first.
- The link's utilisation is the bytes recorded over the last `--prfaas-link-window-s` over its
  capacity. At most once per `--prfaas-adapt-interval-s` the threshold rises (fewer prompts cross)
  when the link or the remote queue saturates, falls when only the local queue does, and otherwise
  drifts back to the configured value, always within the configured bounds.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import partial

from kvgate.config.settings import LOCAL_CLUSTER, PrfaasBandwidthMode, Settings
from kvgate.scheduler.length_profile import LengthProfile
from kvgate.scheduler.types import Candidate

MIB = 1 << 20


@dataclass(frozen=True, slots=True)
class PrfaasRequest:
    num_prompt_tokens: int
    local_hit_tokens: int  # longest cached prefix on any local instance
    prfaas_hit_tokens: int  # longest cached prefix on any PrfaaS instance


@dataclass(frozen=True, slots=True)
class PrefillQueues:
    """Uncomputed prompt tokens queued per prefill instance in each cluster (account + engine stats)."""

    local_tokens_per_instance: float
    prfaas_tokens_per_instance: float


@dataclass(frozen=True, slots=True)
class ClusterDecision:
    """Where prefill runs and why (what /debug/schedule shows)."""

    cluster: str  # LOCAL_CLUSTER or the PrfaaS cluster's name
    offloaded: bool
    mode: PrfaasBandwidthMode  # the mode applied: scarce or abundant, never auto
    threshold_tokens: int  # the threshold in force for this decision
    incremental_tokens: int  # prompt tokens the chosen cluster computes
    prefix_tokens: int  # cached prompt tokens it reuses
    prefix_cluster: str  # where those cached tokens were
    shipped_prefix_tokens: int  # cached tokens copied across the link before prefill
    egress_bytes: int  # bytes this request will put on the PrfaaS -> local link
    link_utilisation: float
    reason: str


class KVSize:
    """KV cache bytes of a prompt of n tokens: a table by length (interpolated) or bytes per token."""

    def __init__(self, table_mib: dict[int, float], bytes_per_token: float) -> None:
        self._profile = LengthProfile.from_points(table_mib) if table_mib else None
        self._bytes_per_token = bytes_per_token

    def bytes(self, tokens: int) -> int:
        if tokens <= 0:
            return 0
        if self._profile is not None:
            return int(self._profile.value(tokens) * MIB)
        return int(tokens * self._bytes_per_token)


class LinkMeter:
    """Bytes put on the link over a sliding window, as a rate and as a share of capacity."""

    def __init__(self, capacity_bytes_per_s: float, window_s: float) -> None:
        self.capacity_bytes_per_s = capacity_bytes_per_s
        self.window_s = window_s
        self._events: deque[tuple[float, int]] = deque()
        self._bytes_in_window = 0

    def record(self, now: float, nbytes: int) -> None:
        if nbytes > 0:
            self._events.append((now, nbytes))
            self._bytes_in_window += nbytes
        self._expire(now)

    def bytes_per_s(self, now: float) -> float:
        self._expire(now)
        return self._bytes_in_window / self.window_s

    def utilisation(self, now: float) -> float:
        return self.bytes_per_s(now) / self.capacity_bytes_per_s

    def _expire(self, now: float) -> None:
        while self._events and self._events[0][0] <= now - self.window_s:
            self._bytes_in_window -= self._events.popleft()[1]


class ThresholdController:
    """The offload threshold, moved by link and queue saturation within [min, max]."""

    def __init__(self, settings: Settings) -> None:
        self.base = settings.prfaas_threshold_tokens
        self.low = settings.prfaas_threshold_min_tokens
        self.high = settings.prfaas_threshold_max_tokens
        self.factor = settings.prfaas_adapt_factor
        self.interval_s = settings.prfaas_adapt_interval_s
        self.link_saturated = settings.prfaas_link_saturated_utilisation
        self.queue_saturated = settings.prfaas_queue_saturated_tokens
        self.threshold = self.base
        self.last_change = "configured"
        self._next_adapt_s: float | None = None

    def adapt(self, now: float, link_utilisation: float, queues: PrefillQueues) -> None:
        if self._next_adapt_s is not None and now < self._next_adapt_s:
            return
        self._next_adapt_s = now + self.interval_s
        before = self.threshold
        if link_utilisation >= self.link_saturated:
            target, why = self._raised(), f"link {link_utilisation:.0%} >= {self.link_saturated:.0%}"
        elif queues.prfaas_tokens_per_instance >= self.queue_saturated:
            target, why = self._raised(), "PrfaaS prefill queue saturated"
        elif queues.local_tokens_per_instance >= self.queue_saturated:
            target, why = max(self.low, int(before / self.factor)), "local prefill queue saturated"
        elif before > self.base:
            target, why = max(self.base, int(before / self.factor)), "calm: back toward the configured value"
        elif before < self.base:
            target, why = min(self.base, int(before * self.factor)), "calm: back toward the configured value"
        else:
            return
        if target != before:
            self.threshold = target
            self.last_change = f"{why}: {before} -> {target}"

    def _raised(self) -> int:
        return min(self.high, max(int(self.threshold * self.factor), self.threshold + 1))


class PrfaasRouter:
    """The cluster decision for each request, with the link estimate and the adaptive threshold."""

    def __init__(self, settings: Settings, *, judge_cached_prefix: bool = True) -> None:
        """`judge_cached_prefix=False` is the naive rule the simulator compares with: every prompt
        longer than the threshold crosses, whatever either cluster holds of it."""
        if not settings.prfaas_cluster:
            raise ValueError("PrfaasRouter needs --prfaas-cluster")
        self.cluster = settings.prfaas_cluster
        self.judge_cached_prefix = judge_cached_prefix
        self.mode = settings.prfaas_bandwidth_mode
        self.abundant_below = settings.prfaas_abundant_below_utilisation
        self.kv_size = KVSize(settings.prfaas_kv_size_mib, settings.prfaas_kv_bytes_per_token)
        self.link = LinkMeter(settings.prfaas_egress_gbps * 1e9 / 8, settings.prfaas_link_window_s)
        self.controller = ThresholdController(settings)
        self._decisions: deque[tuple[float, bool]] = deque()
        self._offloaded_in_window = 0

    def decide(
        self,
        request: PrfaasRequest,
        now: float,
        queues: PrefillQueues,
        *,
        prfaas_available: bool = True,
        local_available: bool = True,
        dry_run: bool = False,
    ) -> ClusterDecision:
        """`dry_run` (the debug route) neither adapts the threshold nor counts the decision."""
        utilisation = self.link.utilisation(now)
        if not dry_run:
            self.controller.adapt(now, utilisation, queues)
        threshold = self.controller.threshold
        total = max(request.num_prompt_tokens, 0)
        local_hit = min(max(request.local_hit_tokens, 0), total) if self.judge_cached_prefix else 0
        remote_hit = min(max(request.prfaas_hit_tokens, 0), total) if self.judge_cached_prefix else 0
        mode = self._mode(utilisation)
        build = partial(self._decision, mode, threshold, utilisation, total)
        if not prfaas_available:
            # Nothing remote to prefill on or fetch a prefix from: local PD with the local prefix.
            decision = build(False, local_hit, LOCAL_CLUSTER, "no PrfaaS instance up")
        elif not local_available:
            decision = build(True, remote_hit, self.cluster, "no local prefill instance up")
        elif mode == PrfaasBandwidthMode.ABUNDANT:
            # The longer prefix counts wherever it lies (a tie stays local: nothing to ship).
            prefix, where = (
                (local_hit, LOCAL_CLUSTER) if local_hit >= remote_hit else (remote_hit, self.cluster)
            )
            why = f"abundant link ({utilisation:.0%}): incremental {total - prefix}"
            if total - prefix <= threshold:
                decision = build(False, prefix, where, f"{why} <= threshold {threshold}")
            else:
                decision = build(True, prefix, where, f"{why} > threshold {threshold}")
        else:
            # Judged on the local prefix alone; remote prefill then reuses what the remote side holds.
            why = f"scarce link ({utilisation:.0%}): incremental {total - local_hit} after the local prefix"
            if total - local_hit <= threshold:
                decision = build(False, local_hit, LOCAL_CLUSTER, f"{why} <= threshold {threshold}")
            else:
                decision = build(True, remote_hit, self.cluster, f"{why} > threshold {threshold}")
        if not dry_run:
            self._count(now, decision.offloaded)
        return decision

    def _decision(
        self,
        mode: PrfaasBandwidthMode,
        threshold: int,
        utilisation: float,
        total: int,
        offloaded: bool,
        prefix: int,
        where: str,
        why: str,
    ) -> ClusterDecision:
        """Prefill in the PrfaaS cluster (`offloaded`) or locally, reusing `prefix` cached tokens held
        in cluster `where`; a prefix held on the other side than the prefill is shipped across."""
        shipped = prefix if (where == LOCAL_CLUSTER) == offloaded else 0
        return ClusterDecision(
            cluster=self.cluster if offloaded else LOCAL_CLUSTER,
            offloaded=offloaded,
            mode=mode,
            threshold_tokens=threshold,
            incremental_tokens=total - prefix,
            prefix_tokens=prefix,
            prefix_cluster=where,
            shipped_prefix_tokens=shipped,
            # Offloaded, the whole prompt's KV reaches the local decode instance, the reused prefix
            # included; a local prefix shipped to the PrfaaS cluster travels the other way and is not
            # egress. Local, only a prefix shipped from the PrfaaS cluster crosses the link.
            egress_bytes=self.kv_size.bytes(total if offloaded else shipped),
            link_utilisation=utilisation,
            reason=why + (f"; {shipped} cached tokens shipped {'to' if offloaded else 'from'} {self.cluster}"
                          if shipped else ""),
        )

    def record_egress(self, now: float, nbytes: int) -> None:
        """Bytes that started crossing the link (a remote prefill's KV, a shipped prefix)."""
        self.link.record(now, nbytes)

    def egress_gbps(self, now: float) -> float:
        """The link's estimated egress over the window, Gbit/s."""
        return self.link.bytes_per_s(now) * 8 / 1e9

    def offload_fraction(self, now: float) -> float:
        """Share of the decisions within the link window that went to the PrfaaS cluster."""
        self._expire(now)
        return self._offloaded_in_window / len(self._decisions) if self._decisions else 0.0

    def _mode(self, utilisation: float) -> PrfaasBandwidthMode:
        if self.mode != PrfaasBandwidthMode.AUTO:
            return self.mode
        return (
            PrfaasBandwidthMode.ABUNDANT if utilisation < self.abundant_below else PrfaasBandwidthMode.SCARCE
        )

    def _count(self, now: float, offloaded: bool) -> None:
        self._decisions.append((now, offloaded))
        self._offloaded_in_window += offloaded
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._decisions and self._decisions[0][0] <= now - self.link.window_s:
            self._offloaded_in_window -= self._decisions.popleft()[1]


@dataclass(frozen=True, slots=True)
class ClusterView:
    """One request as the rule sees the two clusters: the prefill candidates of each, its longest
    cached prefix in each (any instance of the cluster: the store serves it within the cluster) and
    the mean queued prefill tokens per instance (the dispatch account merged with engine stats)."""

    local: tuple[Candidate, ...]
    prfaas: tuple[Candidate, ...]
    request: PrfaasRequest
    queues: PrefillQueues


def cluster_view(
    num_prompt_tokens: int,
    prefill_candidates: Sequence[Candidate],
    hit_tokens: Mapping[str, int],
    cluster_of: Mapping[str, str],
    prfaas_cluster: str,
) -> ClusterView:
    def in_prfaas(instance_id: str) -> bool:
        return cluster_of.get(instance_id, LOCAL_CLUSTER) == prfaas_cluster

    remote = tuple(c for c in prefill_candidates if in_prfaas(c.id))
    local = tuple(c for c in prefill_candidates if not in_prfaas(c.id))
    local_hit = max((t for i, t in hit_tokens.items() if not in_prfaas(i)), default=0)
    remote_hit = max((t for i, t in hit_tokens.items() if in_prfaas(i)), default=0)
    return ClusterView(
        local,
        remote,
        PrfaasRequest(num_prompt_tokens, local_hit, remote_hit),
        PrefillQueues(_mean_queue(local), _mean_queue(remote)),
    )


def _mean_queue(candidates: Sequence[Candidate]) -> float:
    if not candidates:
        return 0.0
    return sum(c.load.all_prefills_tokens_num for c in candidates) / len(candidates)
