"""`kvgate bench overhead --floor`: the bare relay (aiohttp + the upstream client) as a measured target."""

from __future__ import annotations

from kvgate.bench.overhead import FLOOR, OverheadConfig, measure, render
from kvgate.bench.routers.targets import DIRECT


def test_the_bare_relay_relays_every_request_and_reports_its_cpu(tmp_path):
    config = OverheadConfig(concurrency=(2,), duration_s=0.3, max_requests=40, runs=1, workers=(), peers=False,
                            floor=True)
    [row] = measure(config, tmp_path)
    assert row.labels == [FLOOR] and row.errors(FLOOR) == 0 and row.errors(DIRECT) == 0
    [run] = row.runs
    relayed = run.routed[FLOOR]
    # CPU per request: the relay's CPU over every answer the loop received, as for a gateway.
    assert relayed.result.requests > 0 and relayed.cpu_ms_per_request is not None and relayed.cpu_ms_per_request > 0
    assert row.added_ms(FLOOR, "p50") is not None and FLOOR in render([row])
