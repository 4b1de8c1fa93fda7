"""`kvgate bench soak` at a tiny size: real gateway, mock engines and redis-server, faults injected."""

from __future__ import annotations

from collections import Counter

import pytest

from kvgate.bench.soak import (
    ALLOWED,
    CUT_BY_FAULT,
    HOSTILE,
    HOSTILE_HEADERS,
    HUNG_UP,
    LYING,
    OK,
    WELL_FORMED,
    SoakConfig,
    run_soak,
)

pytestmark = [pytest.mark.redis, pytest.mark.timeout(240)]


def test_a_tiny_soak_loses_nothing_and_leaves_nothing_in_flight(tmp_path):
    config = SoakConfig(requests=60, concurrency=4, engines=2, hangup_every=5, slow_every=7, hostile_every=6,
                        lying_every=7, duration_s=120)
    report = run_soak(config, tmp_path)
    assert len(report.outcomes) == config.requests
    by_category = Counter(o.category for o in report.outcomes)
    assert by_category[HOSTILE] == 10 and by_category[LYING] >= 6 and by_category[WELL_FORMED] >= 40
    # Every hostile header was sent; every lying-engine request asked the lying engine's model.
    assert {o.kind for o in report.outcomes if o.category == HOSTILE} == set(HOSTILE_HEADERS)
    assert all(o.kind.startswith(("chat", "completion")) for o in report.outcomes if o.category == LYING)
    well_formed = {o.result for o in report.outcomes if o.category == WELL_FORMED}
    assert well_formed <= {OK, HUNG_UP, CUT_BY_FAULT}, report.lost
    assert not report.lost
    assert HUNG_UP in well_formed and any("slow-reader" in o.kind and o.result == OK for o in report.outcomes)
    # Every fault ran, each restart after its kill, the poisoned peer last.
    assert [f.done_s is not None for f in report.faults] == [True] * 5
    assert report.faults[0].at_s <= report.faults[1].at_s and report.faults[2].at_s <= report.faults[3].at_s
    assert report.gateway_counters["peer values dropped (account sync)"] >= 8
    assert report.inflight_at_end == 0
    assert report.gateway_counters["client hang-ups (499)"] >= 1
    assert [s.label for s in report.samples] == ["start", "middle", "end"]
    assert all(s.rss_mb > 0 and s.open_files > 0 for s in report.samples)
    # Hostile and lying-engine requests are counted apart: the gateway must answer each (a 4xx is fine
    # for hostile headers); a 500, a dropped connection or a silently cut stream is mishandled.
    assert all(o.result != "timeout" and not o.result.startswith("client_") for o in report.outcomes)
    assert not any(o.result.startswith("http_5") and o.result not in ALLOWED[o.category] for o in report.outcomes)
