"""Replay one workload through the same fleet twice, round robin then cache aware, fresh each time.

Both runs send identical requests at identical times to identical empty engines; only the
gateway's policy differs, so every difference in the table is the routing's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson

from kvgate.bench.loadgen import ReplaySummary, ScheduledRequest, replay, summarize_replay
from kvgate.bench.workload import ReplayRequest, build_requests, completion_body
from kvgate.demo.fleet import FleetSpec, running_fleet
from kvgate.simulator.trace import read_trace

POLICIES = ("round_robin", "cache_aware")


@dataclass(frozen=True)
class PolicyRun:
    policy: str  # the column's name: the policy, or the fleet (kvgate demo --prfaas)
    summary: ReplaySummary
    # Figures read from the gateway after the replay (label -> shown value), e.g. the PrfaaS link's.
    gateway: dict[str, str] = field(default_factory=dict)


def trace_requests(path: str, limit: int, time_scale: float, max_tokens_cap: int) -> list[ReplayRequest]:
    """The trace's first `limit` requests, arriving `time_scale` times as far apart as recorded.

    The engines' GPU time is scaled by the same factor, so the fleet sees the trace's own load.
    """
    records = read_trace(path, limit=limit)
    return build_requests(records, speedup=1 / time_scale, max_tokens_cap=max_tokens_cap)


def scheduled_requests(requests: Sequence[ReplayRequest], model: str) -> list[ScheduledRequest]:
    return [ScheduledRequest(r.index, r.send_at_s, orjson.dumps(completion_body(r, model))) for r in requests]


async def run_policy(
    spec: FleetSpec,
    policy: str,
    requests: Sequence[ReplayRequest],
    tokenizer: Any,
    progress: bool = True,
    timeout_s: float = 120.0,
    *,
    label: str | None = None,
    read_gateway: Callable[[str], Awaitable[dict[str, str]]] | None = None,
) -> PolicyRun:
    """`label` names the column (default: the policy); `read_gateway(url)` reads figures from the
    gateway once the replay is over, before it stops."""
    scheduled = scheduled_requests(requests, spec.engine.model)
    label = label or policy
    figures: dict[str, str] = {}
    async with running_fleet(spec, policy, tokenizer) as gateway_url:
        summary = await replay_through(gateway_url, scheduled, label, progress, timeout_s)
        if read_gateway is not None:
            figures = await read_gateway(gateway_url)
    return PolicyRun(label, summary, figures)


async def replay_through(
    gateway_url: str, scheduled: Sequence[ScheduledRequest], label: str, progress: bool, timeout_s: float
) -> ReplaySummary:
    """Replay `scheduled` through the gateway at `gateway_url`, with a progress bar named `label`."""
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(scheduled), unit="req", desc=f"{label:>12}", file=sys.stderr, leave=True)
    started = time.perf_counter()
    try:
        outcomes = await replay(
            f"{gateway_url}/v1/completions",
            scheduled,
            timeout_s=timeout_s,
            on_done=(lambda _: bar.update()) if bar is not None else None,
        )
    finally:
        if bar is not None:
            bar.close()
    return summarize_replay(outcomes, time.perf_counter() - started)


async def run_demo(
    spec: FleetSpec, requests: Sequence[ReplayRequest], tokenizer: Any, progress: bool = True
) -> list[PolicyRun]:
    return [await run_policy(spec, policy, requests, tokenizer, progress) for policy in POLICIES]
