"""`kvgate bench soak` at a tiny size: real gateway, mock engines and redis-server, faults injected."""

from __future__ import annotations

import pytest

from kvgate.bench.soak import CUT_BY_FAULT, HUNG_UP, OK, SoakConfig, run_soak

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]


def test_a_tiny_soak_loses_nothing_and_leaves_nothing_in_flight(tmp_path):
    config = SoakConfig(requests=40, concurrency=4, engines=2, hangup_every=5, slow_every=7, duration_s=120)
    report = run_soak(config, tmp_path)
    assert len(report.outcomes) == config.requests
    results = {o.result for o in report.outcomes}
    assert results <= {OK, HUNG_UP, CUT_BY_FAULT}, [o for o in report.outcomes if o.result not in (OK, HUNG_UP)]
    assert HUNG_UP in results and any("slow-reader" in o.kind and o.result == OK for o in report.outcomes)
    # Every fault ran, each restart after its kill.
    assert [f.done_s is not None for f in report.faults] == [True] * 4
    assert report.faults[0].at_s <= report.faults[1].at_s and report.faults[2].at_s <= report.faults[3].at_s
    assert report.inflight_at_end == 0 and report.passed
    assert report.gateway_counters["client hang-ups (499)"] >= 1
    assert [s.label for s in report.samples] == ["start", "middle", "end"]
    assert all(s.rss_mb > 0 and s.open_files > 0 for s in report.samples)
