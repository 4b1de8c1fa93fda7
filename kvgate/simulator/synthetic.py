"""A synthetic workload in the trace's own form: prompt lengths from a truncated log-normal (the
planner's distribution, planner/workload.py), Poisson arrivals, fresh blocks for every request (no
prefix is shared, so the cluster rule judges total lengths)."""

from __future__ import annotations

import math

import numpy as np

from kvgate.planner.workload import truncated_lognormal
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest


def parse_lognormal(spec: str) -> tuple[float, float, float, float]:
    """'MU,SIGMA,MIN,MAX' (the log-normal of ln(length) and its truncation, tokens)."""
    try:
        mu, sigma, low, high = (float(part) for part in spec.split(","))
    except ValueError:
        raise ValueError(f"--lognormal: expected MU,SIGMA,MIN,MAX, e.g. 9.90,1.00,128,131072 (got {spec!r})") from None
    return mu, sigma, low, high


def lognormal_requests(
    num_requests: int, rate_rps: float, mu: float, sigma: float, low: float, high: float, output_tokens: int,
    seed: int = 0,
) -> list[TraceRequest]:
    if num_requests < 1 or rate_rps <= 0 or output_tokens < 1:
        raise ValueError("a log-normal workload needs requests >= 1, a rate > 0 and output tokens >= 1")
    distribution = truncated_lognormal(mu, sigma, low, high)
    rng = np.random.default_rng(seed)
    lengths = rng.choice(distribution.lengths, size=num_requests, p=distribution.weights)
    gaps = rng.exponential(1.0 / rate_rps, size=num_requests)
    requests = []
    arrival = 0.0
    next_block = 0
    for index, (length, gap) in enumerate(zip(lengths, gaps, strict=True)):
        tokens = max(1, round(float(length)))
        blocks = math.ceil(tokens / TRACE_BLOCK_TOKENS)
        requests.append(TraceRequest(index, arrival, tokens, output_tokens,
                                     tuple(range(next_block, next_block + blocks))))
        next_block += blocks
        arrival += float(gap)
    return requests
