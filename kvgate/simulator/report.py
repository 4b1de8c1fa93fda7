"""What a simulated replay measured, and the arithmetic that summarises it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100) of already sorted values; NaN when empty."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass(frozen=True)
class HitRatioReference:
    """What the trace allows, to read the policies' hit ratios against."""

    ideal: float
    fleet_lru: float


@dataclass(frozen=True)
class SLOOutcome:
    """Requests against the SLOs (an SLO of 0 is no constraint)."""

    rejected: int
    within_slo: int
    arrived: int

    @classmethod
    def measure(
        cls, ttfts: Sequence[float], tbts: Sequence[float], rejected: Sequence[bool], ttft_slo_s: float,
        tbt_slo_s: float,
    ) -> SLOOutcome:
        """`ttfts`/`tbts` per arrived request, NaN for one rejected or unfinished."""
        within = sum(
            1
            for ttft, tbt in zip(ttfts, tbts, strict=True)
            if not math.isnan(tbt)
            and (ttft_slo_s <= 0 or ttft <= ttft_slo_s)
            and (tbt_slo_s <= 0 or tbt <= tbt_slo_s)
        )
        return cls(sum(rejected), within, len(ttfts))


@dataclass(frozen=True)
class SimulationSummary:
    policy: str
    instances: int
    requests: int
    # Cached prompt tokens / prompt tokens, as the engines counted them at admission.
    prefix_hit_ratio: float
    # The same with one infinite cache shared by all instances (see trace.ideal_hit_ratio).
    ideal_hit_ratio: float
    # The same with one LRU cache as large as the fleet's (see trace.fleet_lru_hit_ratio).
    fleet_lru_hit_ratio: float
    mean_ttft_s: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    # Time from arrival to admission into an engine's running batch.
    mean_queue_s: float
    p90_queue_s: float
    throughput_rps: float
    # Fraction of instance time spent in steps that prefill: how close prefill capacity is to full.
    prefill_busy_ratio: float
    # Virtual time from the first arrival to the last finish.
    makespan_s: float
    # Requests per instance, most loaded / least loaded: how uneven the placement was.
    max_instance_requests: int
    min_instance_requests: int
    engine_steps: int
    wall_time_s: float
    # Fraction of arrived requests served within both SLOs, and those per second of makespan.
    slo_attainment: float
    goodput_rps: float
    # Requests the rejection filter refused (429 at a gateway).
    rejected: int
    # Prompt tokens loaded from other instances' segments of the shared store (0 with a local store).
    transfer_tokens: int

    def to_dict(self) -> dict:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in asdict(self).items()}


def summarise(
    *,
    policy: str,
    ttfts: Sequence[float],
    queue_times: Sequence[float],
    arrivals: Sequence[float],
    finishes: Sequence[float],
    per_instance_requests: Sequence[int],
    cached_tokens: int,
    prompt_tokens: int,
    reference: HitRatioReference,
    prefill_time_s: float,
    engine_steps: int,
    wall_time_s: float,
    slo: SLOOutcome,
    transfer_tokens: int,
) -> SimulationSummary:
    ttft_sorted = sorted(ttfts)
    queue_sorted = sorted(queue_times)
    makespan = (max(finishes) - min(arrivals)) if finishes else 0.0
    return SimulationSummary(
        policy=policy,
        instances=len(per_instance_requests),
        requests=len(ttfts),
        prefix_hit_ratio=cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        ideal_hit_ratio=reference.ideal,
        fleet_lru_hit_ratio=reference.fleet_lru,
        mean_ttft_s=sum(ttft_sorted) / len(ttft_sorted) if ttft_sorted else math.nan,
        p50_ttft_s=percentile(ttft_sorted, 50),
        p90_ttft_s=percentile(ttft_sorted, 90),
        p99_ttft_s=percentile(ttft_sorted, 99),
        mean_queue_s=sum(queue_sorted) / len(queue_sorted) if queue_sorted else math.nan,
        p90_queue_s=percentile(queue_sorted, 90),
        throughput_rps=len(finishes) / makespan if makespan > 0 else math.nan,
        prefill_busy_ratio=prefill_time_s / (makespan * len(per_instance_requests))
        if makespan > 0
        else math.nan,
        makespan_s=makespan,
        max_instance_requests=max(per_instance_requests, default=0),
        min_instance_requests=min(per_instance_requests, default=0),
        engine_steps=engine_steps,
        wall_time_s=wall_time_s,
        slo_attainment=slo.within_slo / slo.arrived if slo.arrived else math.nan,
        goodput_rps=slo.within_slo / makespan if makespan > 0 else math.nan,
        rejected=slo.rejected,
        transfer_tokens=transfer_tokens,
    )
