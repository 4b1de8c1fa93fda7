"""`kvgate bench overhead`: medians over runs, and one small real run (instant backend, `kvgate serve`
and the load generator as processes) for whole and streamed answers."""

from __future__ import annotations

import pytest

from kvgate.bench.loadgen import ClosedLoopResult, LatencyStats
from kvgate.bench.overhead import (
    PEER,
    OverheadConfig,
    OverheadRow,
    OverheadRun,
    RoutedLoop,
    gateway_label,
    measure,
    render,
)
from kvgate.bench.routers.targets import DIRECT


def loop(p50_ms: float, rate: float, errors: int = 0) -> ClosedLoopResult:
    seconds = p50_ms / 1000
    latency = LatencyStats(count=10, mean=seconds, p50=seconds, p90=seconds, p99=2 * seconds, max=2 * seconds)
    return ClosedLoopResult(concurrency=1, requests=10, errors={"timeout": errors} if errors else {},
                            duration_s=1.0, requests_per_s=rate, latency=latency)


W1, W2 = gateway_label(1), gateway_label(2)


def test_figures_are_medians_over_runs_of_each_runs_own_difference():
    row = OverheadRow(1, (
        OverheadRun(loop(1.0, 1000), {W1: RoutedLoop(loop(1.5, 800), {"kvgate serve": 0.2}), PEER.label: RoutedLoop(loop(1.2, 400))}),
        # A run where /proc could not be read, and the peer did not run.
        OverheadRun(loop(3.0, 900), {W1: RoutedLoop(loop(3.1, 700))}),
        OverheadRun(loop(2.0, 950), {W1: RoutedLoop(loop(2.4, 600, errors=2), {"kvgate serve": 0.4}),
                                     PEER.label: RoutedLoop(loop(2.2, 1200))}),
    ))
    assert row.labels == [W1, PEER.label]
    assert row.added_ms(W1, "p50") == pytest.approx(0.4)  # median of 0.5, 0.1, 0.4
    assert row.latency_ms(W1, "p50") == pytest.approx(2.4)
    assert row.requests_per_s(DIRECT) == 950 and row.requests_per_s(W1) == 700
    assert row.rate_ratio(W1, PEER.label) == pytest.approx((2.0 + 0.5) / 2)  # runs with both: 800/400, 600/1200
    assert row.cpu_ms_per_request(W1) == pytest.approx(0.3)
    assert row.errors(W1) == 2 and row.errors(DIRECT) == 0
    lines = render([row]).splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    cells = {line.split("|")[2].strip(): dict(zip(header, (c.strip() for c in line.split("|")), strict=True))
             for line in lines[2:]}
    assert cells[W1]["added p50 ms"] == "0.400" and cells[W1]["req/s"] == "700" and cells[W1]["errors"] == "2"
    assert cells[DIRECT]["added p50 ms"] == "(baseline)"


@pytest.mark.parametrize("stream,workers", [(False, (1,)), (True, (2,))])
def test_small_real_run(tmp_path, stream, workers):
    config = OverheadConfig(concurrency=(2,), duration_s=0.3, max_requests=40, runs=2, stream=stream,
                            workers=workers, peers=False)
    [row] = measure(config, tmp_path)
    label = gateway_label(workers[0])
    assert row.concurrency == 2 and len(row.runs) == 2 and row.labels == [label]
    assert row.errors(DIRECT) == 0 and row.errors(label) == 0
    for run in row.runs:
        assert run.direct.requests > 0 and run.routed[label].result.requests > 0
        assert run.routed[label].cpu_ms_per_request is not None and run.routed[label].cpu_ms_per_request > 0
    assert row.added_ms(label, "p50") is not None
