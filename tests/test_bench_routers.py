"""The router benchmark's parts that run without the full benchmark: peer commands, the peers'
virtualenv check, target parsing, the generated kvgate config, CPU split, figures and the plot."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from kvgate.bench import peers
from kvgate.bench.loadgen import ClosedLoopResult, LatencyStats, summarize_replay
from kvgate.bench.routers.phases import gateway_stage_ms, serves_tokenize
from kvgate.bench.routers.processes import Engine, cpu_split, kvgate_config, pinned
from kvgate.bench.routers.report import added_latency_ms, plot, results_json, table_rows
from kvgate.bench.routers.targets import DEFAULT_TARGETS, DIRECT, RoutersConfig, Target, TargetResult
from kvgate.config.settings import Settings

WORKERS = ["http://127.0.0.1:9001", "http://127.0.0.1:9002"]


def env(tmp_path: Path) -> peers.PeerEnvironment:
    return peers.PeerEnvironment(tmp_path / "venv")


def test_sglang_router_command(tmp_path):
    argv = peers.sglang_router_command(env(tmp_path), port=8100, metrics_port=8101, worker_urls=WORKERS,
                                       policy="cache_aware")
    assert argv[:3] == [str(tmp_path / "venv" / "bin" / "python"), "-m", "sglang_router.launch_router"]
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 8100" in joined
    assert "--worker-urls http://127.0.0.1:9001 http://127.0.0.1:9002 --policy cache_aware" in joined
    # REFERENCE.md section 9's thresholds, and metrics off the default port 29000 (two routers clash there).
    assert "--cache-threshold 0.3 --balance-abs-threshold 64 --balance-rel-threshold 1.5" in joined
    assert "--prometheus-host 127.0.0.1 --prometheus-port 8101" in joined


def test_vllm_router_command(tmp_path):
    argv = peers.vllm_router_command(env(tmp_path), port=8200, metrics_port=8201, worker_urls=WORKERS[:1],
                                     policy="round_robin")
    assert argv[0] == str(tmp_path / "venv" / "bin" / "vllm-router")
    joined = " ".join(argv)
    assert "--host 127.0.0.1 --port 8200 --worker-urls http://127.0.0.1:9001 --policy round_robin" in joined
    assert "--prometheus-host 127.0.0.1 --prometheus-port 8201" in joined
    assert all("0.0.0.0" not in part for part in argv)


def test_missing_peers_are_unavailable_without_install(tmp_path):
    result = peers.ensure_peers(tmp_path / "none", install=False)
    assert result.ready == {}
    assert set(result.unavailable) == set(peers.PEER_VERSIONS)
    assert "sglang-router==0.3.2 not in" in result.unavailable["sglang-router"]
    assert not (tmp_path / "none").exists()  # nothing created


def test_default_venv_dir_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert peers.default_venv_dir() == tmp_path / "kvgate" / "bench-venv"


def test_targets():
    assert Target.parse("direct") == Target(DIRECT)
    assert Target.parse("sglang-router:cache_aware").label == "sglang-router cache_aware"
    with pytest.raises(ValueError, match="unknown router"):
        Target.parse("nginx:round_robin")
    with pytest.raises(ValueError, match="policy"):
        Target.parse("kvgate:random")
    with pytest.raises(ValueError, match="policy"):
        Target.parse("sglang-router:prefix")  # peers only share kvgate's two policies
    assert Target.parse("kvgate:prefix") == Target("kvgate", "prefix")  # any kvgate policy
    assert DEFAULT_TARGETS[0] == Target(DIRECT) and len(DEFAULT_TARGETS) == 7
    # `kvgate serve --workers`: kvgate:policy:N, or --workers expanding every kvgate target.
    assert Target.parse("kvgate:cache_aware:2") == Target("kvgate", "cache_aware", 2)
    assert Target("kvgate", "cache_aware", 2).label == "kvgate cache_aware x2"
    with pytest.raises(ValueError, match="only kvgate"):
        Target.parse("sglang-router:cache_aware:2")
    with pytest.raises(ValueError, match="positive"):
        Target.parse("kvgate:cache_aware:0")
    assert Target("kvgate", "cache_aware").with_workers((1, 2)) == [
        Target("kvgate", "cache_aware", 1), Target("kvgate", "cache_aware", 2)]
    assert Target(DIRECT).with_workers((1, 2)) == [Target(DIRECT)]


def test_kvgate_config_is_valid_settings():
    engines = [Engine("http://127.0.0.1:9001", "127.0.0.2"), Engine("http://127.0.0.1:9002", "127.0.0.3")]
    config = kvgate_config("cache_aware", 8300, engines, "redis://127.0.0.1:6390/0", tokenizer="")
    settings = Settings.model_validate(config)
    assert settings.effective_policy == "cache_aware"
    assert [i.kvs_endpoints for i in settings.instances] == [("127.0.0.2",), ("127.0.0.3",)]
    assert settings.kvs_redis_url == "redis://127.0.0.1:6390/0" and settings.host == "127.0.0.1"
    assert settings.workers == 1  # one process unless asked: the replay pins the router to its cores
    overhead = Settings.model_validate(kvgate_config("cache_aware", 8300, engines, "redis://x:1/0", "", 2, 256))
    assert overhead.workers == 2 and overhead.cache_aware_scheduling_min_tokens == 256


def test_cpu_split_and_pinning():
    split = cpu_split()
    available = os.sched_getaffinity(0)
    if len(available) < 2:
        assert split is None
        return
    router_cpus, others = split
    assert router_cpus and others and not router_cpus & others and router_cpus | others == available
    with pinned(others):
        assert os.sched_getaffinity(0) == others
    assert os.sched_getaffinity(0) == available


async def test_gateway_stage_means_and_tokenize_probe():
    """Read over real HTTP: kvgate's stage histogram, and a backend that does not serve /tokenize."""
    from aiohttp import web

    from kvgate.bench.instant_backend import make_app

    metrics = "\n".join([
        "# TYPE kvgate_stage_seconds histogram",
        'kvgate_stage_seconds_bucket{stage="tokenize",le="+Inf"} 4.0',
        'kvgate_stage_seconds_count{stage="tokenize"} 4.0',
        'kvgate_stage_seconds_sum{stage="tokenize"} 0.2',
        'kvgate_stage_seconds_bucket{stage="kvs",le="+Inf"} 2.0',
        'kvgate_stage_seconds_count{stage="kvs"} 2.0',
        'kvgate_stage_seconds_sum{stage="kvs"} 0.003',
    ]) + "\n"
    async def gateway_metrics(request: web.Request) -> web.Response:
        return web.Response(text=metrics)

    app = make_app("m")
    app.router.add_get("/gateway-metrics/metrics", gateway_metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        stages = await asyncio.to_thread(gateway_stage_ms, url + "/gateway-metrics")
        tokenize = await asyncio.to_thread(serves_tokenize, Engine(url, ""))
    finally:
        await runner.cleanup()
    assert stages == {"tokenize": pytest.approx(50.0), "kvs": pytest.approx(1.5)}
    assert tokenize is False


def loop(concurrency: int, latencies_ms: list[float], rate: float) -> ClosedLoopResult:
    values = [v / 1000 for v in latencies_ms]
    return ClosedLoopResult(concurrency, len(values), {}, 1.0, rate, LatencyStats.of(values), tuple(sorted(values)))


def sample_results() -> list[TargetResult]:
    from kvgate.bench.loadgen import StreamOutcome

    direct = TargetResult(Target(DIRECT), overhead={1: loop(1, [1.0, 1.0, 3.0], 1000), 32: loop(32, [4.0], 8000)})
    outcomes = [StreamOutcome(0, ttft_s=0.1, prompt_tokens=100, cached_tokens=40, completion_tokens=2),
                StreamOutcome(1, error="http_503")]
    routed = TargetResult(Target("kvgate", "cache_aware"), replay=summarize_replay(outcomes, 1.0),
                          ttfts_s=(0.1,), engine_prompt_tokens=(300, 100), gateway_stage_ms={"tokenize": 42.0},
                          overhead={1: loop(1, [1.5, 1.5, 3.5], 900), 32: loop(32, [5.0], 6000)})
    missing = TargetResult(Target("vllm-router", "round_robin"), status="unavailable", reason="pip install failed")
    return [direct, routed, missing]


def test_figures_are_differences_from_direct():
    direct, routed, missing = sample_results()
    assert added_latency_ms(routed, direct, 1, "p50") == pytest.approx(0.5)
    assert added_latency_ms(routed, direct, 32, "p99") == pytest.approx(1.0)
    assert added_latency_ms(missing, direct, 1, "p50") is None
    assert routed.load_skew == pytest.approx(1.5)
    headers, rows = table_rows([direct, routed, missing], (1, 32))
    by_target = {row[0]: dict(zip(headers, row, strict=True)) for row in rows}
    assert by_target["kvgate cache_aware"]["hit ratio"] == "40.0%"
    assert by_target["kvgate cache_aware"]["+p50 c1 ms"] == "0.50"
    assert by_target["kvgate cache_aware"]["req/s c32"] == "6,000"
    assert "http_503 1" in by_target["kvgate cache_aware"]["note"]
    assert by_target["direct"]["+p50 c1 ms"] == "(1.00)"  # the baseline shows its absolute latency
    assert by_target["vllm-router round_robin"]["note"] == "pip install failed"
    assert by_target["kvgate cache_aware"]["note"].startswith("tokenize stage 42 ms/req")
    document = results_json(RoutersConfig(trace="t.jsonl"), [direct, routed, missing])
    assert document["results"][1]["overhead"]["1"]["added_p50_ms"] == pytest.approx(0.5)
    assert document["results"][2]["status"] == "unavailable"


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "img" / "routers.png"
    plot(sample_results(), (1, 32), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
