"""`kvgate bench overhead`: medians over runs, and one small real run (instant backend, `kvgate serve`
and the load generator as processes) for whole and streamed answers."""

from __future__ import annotations

import pytest

from kvgate.bench.loadgen import ClosedLoopResult, LatencyStats
from kvgate.bench.overhead import OverheadConfig, OverheadRow, OverheadRun, measure, render


def loop(p50_ms: float, rate: float, errors: int = 0) -> ClosedLoopResult:
    seconds = p50_ms / 1000
    latency = LatencyStats(count=10, mean=seconds, p50=seconds, p90=seconds, p99=2 * seconds, max=2 * seconds)
    return ClosedLoopResult(concurrency=1, requests=10, errors={"timeout": errors} if errors else {},
                            duration_s=1.0, requests_per_s=rate, latency=latency)


def test_figures_are_medians_over_runs_of_each_runs_own_difference():
    row = OverheadRow(1, (
        OverheadRun(loop(1.0, 1000), loop(1.5, 800), 0.2),
        OverheadRun(loop(3.0, 900), loop(3.1, 700), None),  # a run where /proc could not be read
        OverheadRun(loop(2.0, 950), loop(2.4, 600, errors=2), 0.4),
    ))
    assert row.added_ms("p50") == pytest.approx(0.4)  # median of 0.5, 0.1, 0.4
    assert row.latency_ms("gateway", "p50") == pytest.approx(2.4)
    assert row.requests_per_s("direct") == 950 and row.requests_per_s("gateway") == 700
    assert row.gateway_cpu_ms_per_request == pytest.approx(0.3)
    assert row.errors == 2
    header, _, line = render([row]).splitlines()
    cells = dict(zip((c.strip() for c in header.split("|")), (c.strip() for c in line.split("|")), strict=True))
    assert cells["added p50 ms"] == "0.4" and cells["gateway req/s"] == "700" and cells["errors"] == "2"


@pytest.mark.parametrize("stream", [False, True])
def test_small_real_run(tmp_path, stream):
    config = OverheadConfig(concurrency=(2,), duration_s=0.3, max_requests=40, runs=2, stream=stream)
    [row] = measure(config, tmp_path)
    assert row.concurrency == 2 and len(row.runs) == 2 and row.errors == 0
    for run in row.runs:
        assert run.direct.requests > 0 and run.gateway.requests > 0
        assert run.gateway_cpu_ms_per_request is not None and run.gateway_cpu_ms_per_request > 0
    assert row.added_ms("p50") is not None
