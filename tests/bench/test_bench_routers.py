"""The router benchmark's parts that run without the full benchmark: peer commands, the peers'
virtualenv check, target parsing, the generated kvgate config, CPU split, figures and the plot."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
from pathlib import Path

import pytest

from kvgate.bench import peers
from kvgate.bench.loadgen import ClosedLoopResult, LatencyStats, summarize_replay
from kvgate.bench.routers import add_parser
from kvgate.bench.routers.command import config_from
from kvgate.bench.routers.command import run as routers_run
from kvgate.bench.routers.phases import (
    engines_figures,
    gateway_hit_comparisons,
    gateway_stage_ms,
    serves_tokenize,
    unavailable_reason,
)
from kvgate.bench.routers.processes import Engine, cpu_split, kvgate_config, pinned, vllm_fleet_specs
from kvgate.bench.routers.report import added_latency_ms, plot, results_json, table_rows
from kvgate.bench.routers.targets import (
    DEFAULT_TARGETS,
    DIRECT,
    VLLM_CACHE_BLOCKS,
    VLLM_MAX_MODEL_LEN,
    RoutersConfig,
    Target,
    TargetResult,
)
from kvgate.bench.routers.trace_slice import cut_prompt, write_slice
from kvgate.config.settings import Settings
from kvgate.engines.model import TINY_MODEL_NAME
from kvgate.engines.vllm import read_prefix_cache_counters
from kvgate.simulator.trace import read_trace

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
    assert Target("kvgate", "cache_aware", 2).label == "kvgate cache_aware@store x2"
    with pytest.raises(ValueError, match="only kvgate"):
        Target.parse("sglang-router:cache_aware:2")
    with pytest.raises(ValueError, match="positive"):
        Target.parse("kvgate:cache_aware:0")
    assert Target("kvgate", "cache_aware").with_workers((1, 2)) == [
        Target("kvgate", "cache_aware", 1), Target("kvgate", "cache_aware", 2)]
    assert Target(DIRECT).with_workers((1, 2)) == [Target(DIRECT)]


def test_target_cache_views():
    """kvgate:policy[@view][:workers]: the store index (default), the engines' KV events, or both."""
    assert Target.parse("kvgate:cache_aware").view == "store"
    events = Target.parse("kvgate:cache_aware@events")
    assert events == Target("kvgate", "cache_aware", 1, "events") and events.label == "kvgate cache_aware@events"
    assert not events.reads_store
    both = Target.parse("kvgate:cache_aware@both:2")
    assert both == Target("kvgate", "cache_aware", 2, "both") and both.reads_store
    assert both.with_workers((1, 3)) == [Target("kvgate", "cache_aware", 1, "both"),
                                         Target("kvgate", "cache_aware", 3, "both")]
    with pytest.raises(ValueError, match="cache view must be one of"):
        Target.parse("kvgate:cache_aware@hbm")
    with pytest.raises(ValueError, match="only kvgate takes a cache view"):
        Target.parse("sglang-router:cache_aware@events")
    assert Target.parse("sglang-router:cache_aware").label == "sglang-router cache_aware"


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


def test_kvgate_config_per_cache_view():
    engines = [Engine("http://127.0.0.1:9001", "127.0.0.2", "tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"),
               Engine("http://127.0.0.1:9002", "127.0.0.3", "tcp://127.0.0.1:7003", "tcp://127.0.0.1:7004")]

    def settings(view: str) -> Settings:
        return Settings.model_validate(kvgate_config("cache_aware", 8300, engines, "redis://127.0.0.1:6390/0", "",
                                                     view=view))

    store, events, both = settings("store"), settings("events"), settings("both")
    assert store.kvs_backend == "redis" and [i.kv_events_endpoint for i in store.instances] == ["", ""]
    assert [i.kvs_endpoints for i in store.instances] == [("127.0.0.2",), ("127.0.0.3",)]
    # Events alone: no store is asked, each instance followed through its own PUB and replay sockets.
    assert events.kvs_backend == "kv_events" and [i.kvs_endpoints for i in events.instances] == [(), ()]
    assert [(i.kv_events_endpoint, i.kv_events_replay_endpoint) for i in events.instances] == [
        ("tcp://127.0.0.1:7001", "tcp://127.0.0.1:7002"), ("tcp://127.0.0.1:7003", "tcp://127.0.0.1:7004")]
    assert both.kvs_backend == "redis" and both.kvs_redis_url == "redis://127.0.0.1:6390/0"
    assert [i.kvs_endpoints for i in both.instances] == [("127.0.0.2",), ("127.0.0.3",)]
    assert [i.kv_events_endpoint for i in both.instances] == ["tcp://127.0.0.1:7001", "tcp://127.0.0.1:7003"]


def test_kvgate_config_for_real_engines_hashes_as_they_do(tmp_path):
    """Real engines: KV events only, their model, context, tokenizer, block size and hash seed."""
    config = RoutersConfig(trace="t", engines_kind="vllm", engines=2, cache_capacity_blocks=512)
    specs = vllm_fleet_specs(config, tmp_path / "model")
    assert [s.core for s in specs] == [0, 1] and all(s.kv_events and s.dev_mode for s in specs)
    assert {s.max_model_len for s in specs} == {VLLM_MAX_MODEL_LEN}
    argv = " ".join(specs[0].argv(tmp_path / "python"))
    assert f"--served-model-name {TINY_MODEL_NAME}" in argv and "--num-gpu-blocks-override 512" in argv
    assert f'"endpoint": "tcp://*:{specs[0].kv_events_port}"' in argv
    engines = [Engine(s.url, "", s.kv_events_endpoint, s.kv_events_replay_endpoint, s.max_model_len) for s in specs]
    matching = {"tokenizer": str(tmp_path / "model"), "kvs_chunk_size": specs[0].block_size,
                "hash_seed": specs[0].hash_seed}
    settings = Settings.model_validate(kvgate_config("cache_aware", 8300, engines, "redis://unused:1/0", "",
                                                     view="events", model=config.model, matching=matching))
    assert settings.kvs_backend == "kv_events" and settings.tokenizer == str(tmp_path / "model")
    assert [(i.model, i.max_model_len, i.kv_events_endpoint) for i in settings.instances] == [
        (TINY_MODEL_NAME, VLLM_MAX_MODEL_LEN, s.kv_events_endpoint) for s in specs]
    assert settings.kvs_chunk_size == 256 and settings.hash_seed == "0"


def routers_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["routers", "--trace", "trace.jsonl", *argv])


def test_flags_mock_engines_defaults():
    config = config_from(routers_args("--targets", "kvgate:cache_aware@events,kvgate:cache_aware@both"))
    assert config.engines_kind == "mock" and config.engines == 4 and config.has_store
    # Each engine's own cache is smaller than the store segment behind it: the views differ.
    assert config.cache_capacity_blocks == 1664 and config.store_segment_blocks == 11648
    assert config.max_prompt_tokens is None and config.model == "kvgate/mock-llm"
    assert [t.view for t in config.targets] == ["events", "both"]
    with pytest.raises(ValueError, match="store-segment-blocks"):
        config_from(routers_args("--store-segment-blocks", "-1"))


def test_flags_real_engines():
    config = config_from(routers_args("--engines-kind", "vllm", "--targets",
                                      "kvgate:cache_aware@events,kvgate:round_robin,sglang-router:cache_aware"))
    # A kvgate target naming no view routes on the KV events: there is no store.
    assert [t.label for t in config.targets] == ["kvgate cache_aware@events", "kvgate round_robin@events",
                                                 "sglang-router cache_aware"]
    assert config.engines == 2 and config.cache_capacity_blocks == VLLM_CACHE_BLOCKS
    assert config.model == TINY_MODEL_NAME and not config.has_store and config.store_segment_blocks == 0
    # Prompts fit the engines' context with room for the capped output, in whole KV blocks.
    assert config.max_prompt_tokens == 7936 and 7936 + config.max_tokens_cap <= VLLM_MAX_MODEL_LEN
    assert config_from(routers_args("--engines-kind", "vllm", "--targets", "kvgate:cache_aware@events",
                                    "--max-prompt-tokens", "2048")).max_prompt_tokens == 2048
    with pytest.raises(ValueError, match="exceed the real engines' context"):
        config_from(routers_args("--engines-kind", "vllm", "--targets", "kvgate:cache_aware@events",
                                 "--max-prompt-tokens", str(VLLM_MAX_MODEL_LEN)))
    with pytest.raises(ValueError, match="at most 8"):
        config_from(routers_args("--engines-kind", "vllm", "--targets", "kvgate:cache_aware@events", "--engines", "9"))


def test_real_engines_refuse_store_views(capsys, tmp_path):
    """No store behind real engines: @store and @both are refused before anything starts."""
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    args = routers_args("--engines-kind", "vllm", "--targets", "kvgate:cache_aware@store,kvgate:cache_aware@both")
    args.trace = str(trace)
    assert routers_run(args) == 2
    err = capsys.readouterr().err
    assert "no store view: kvgate cache_aware@store, kvgate cache_aware@both cannot run" in err
    assert "kvgate:cache_aware@events" in err
    config = RoutersConfig(trace="t", engines_kind="vllm")
    env = peers.PeerEnvironment(tmp_path / "venv")
    assert "use @events" in unavailable_reason(Target("kvgate", "cache_aware", 1, "both"), env, config)
    assert unavailable_reason(Target("kvgate", "cache_aware", 1, "events"), env, config) is None


def test_trace_slice_cuts_prompts_to_their_leading_blocks(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 1500, "output_length": 7, "hash_ids": [1, 2, 3]},
        {"timestamp": 250, "input_length": 1200, "output_length": 0, "hash_ids": [1, 2, 4]},
        {"timestamp": 1500, "input_length": 300, "output_length": 3, "hash_ids": [1]},
        {"timestamp": 1600, "input_length": 900, "output_length": 3, "hash_ids": [9, 8]},
    ]))
    whole = write_slice(str(trace), 3, None, 256, tmp_path)
    assert whole.cut == 0 and whole.prompt_tokens == 3000
    cut = write_slice(str(trace), 3, 600, 256, tmp_path)
    assert [(r.input_length, r.hash_ids) for r in cut.requests] == [(600, (1, 2)), (600, (1, 2)), (300, (1,))]
    assert cut.cut == 2 and cut.prompt_tokens == 1500
    # The file the replay reads is the cut slice, timestamps as the trace had them.
    again = read_trace(cut.path)
    assert [(r.arrival_s, r.input_length, r.output_length, r.hash_ids) for r in again] == [
        (0.0, 600, 7, (1, 2)), (0.25, 600, 0, (1, 2)), (1.5, 300, 3, (1,))]
    # Bound of the cut slice: the 2nd request reuses 512 of its 600 tokens, the 3rd 256 of 300 (whole blocks).
    assert cut.ideal_hit_ratio == pytest.approx((512 + 256) / 1500)
    assert cut_prompt(again[2], 600) is again[2]


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


def hit_accounting_text(counts: dict[tuple[str, str], int]) -> str:
    """kvgate's own hit-accounting counters, as its /metrics shows them."""
    from prometheus_client import CollectorRegistry, generate_latest

    from kvgate.metrics.definitions import hit_metrics

    registry = CollectorRegistry()
    comparisons = hit_metrics(registry).comparisons
    for (instance, outcome), count in counts.items():
        comparisons.labels(instance, outcome).inc(count)
    return generate_latest(registry).decode()


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
    ]) + "\n" + hit_accounting_text({("engine-0", "agree"): 6, ("engine-1", "agree"): 2,
                                      ("engine-1", "engine_higher"): 2, ("engine-1", "unreported"): 5})
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
        comparisons = await asyncio.to_thread(gateway_hit_comparisons, url + "/gateway-metrics")
        tokenize = await asyncio.to_thread(serves_tokenize, Engine(url, ""))
    finally:
        await runner.cleanup()
    assert stages == {"tokenize": pytest.approx(50.0), "kvs": pytest.approx(1.5)}
    assert comparisons == {"agree": 8, "engine_higher": 2, "unreported": 5}
    result = TargetResult(Target("kvgate", "cache_aware"), hit_comparisons=comparisons)
    assert result.view_agreement == pytest.approx(0.8)  # answers without cached tokens are not compared
    assert "view agreed with the engine on 80% (engine higher 2, view higher 0)" in table_rows([result], (1,))[1][0][-1]
    assert tokenize is False


async def test_engines_figures_from_an_engines_own_counters():
    """Read over real HTTP from a mock engine's vllm:prefix_cache_* counters, as from vLLM's: the deltas
    over a run give each engine's prompt tokens and the fleet's hit ratio."""
    import aiohttp

    from kvgate.engine_model import ServiceProfile
    from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine

    engine = await start_mock_engine(MockEngineConfig(time_scale=0.0, profile=ServiceProfile(cache_capacity_blocks=64)))
    prompt = list(range(1000, 1000 + 4 * 256 + 10))  # four whole blocks and a tail
    try:
        async with aiohttp.ClientSession() as session:
            await session.post(engine.url + "/v1/completions", json={"model": "kvgate/mock-llm", "prompt": prompt,
                                                                     "max_tokens": 1})
            before = [await asyncio.to_thread(read_prefix_cache_counters, engine.url)]
            for _ in range(2):  # the run: the same prompt twice, both times four blocks cached
                async with session.post(engine.url + "/v1/completions",
                                        json={"model": "kvgate/mock-llm", "prompt": prompt, "max_tokens": 1}) as r:
                    assert r.status == 200
            after = [await asyncio.to_thread(read_prefix_cache_counters, engine.url)]
    finally:
        await engine.close()
    result = TargetResult(Target("kvgate", "cache_aware"))
    engines_figures(result, before, after)
    assert before[0].queries == len(prompt)  # the request before the run is not counted
    assert result.engine_prompt_tokens == (2 * len(prompt),)
    assert result.engine_hit_ratio == pytest.approx(4 * 256 / len(prompt))


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
                          engine_hit_ratio=0.375, ideal_hit_ratio=0.41,
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
    assert by_target["kvgate cache_aware@store"]["hit ratio"] == "40.0%"
    assert by_target["kvgate cache_aware@store"]["engines' hits"] == "37.5%"
    assert by_target["kvgate cache_aware@store"]["ideal"] == "41.0%"
    assert by_target["kvgate cache_aware@store"]["TTFT P50 ms"] == "100"
    assert by_target["vllm-router round_robin"]["ideal"] == "-"
    assert by_target["kvgate cache_aware@store"]["+p50 c1 ms"] == "0.50"
    assert by_target["kvgate cache_aware@store"]["req/s c32"] == "6,000"
    assert "http_503 1" in by_target["kvgate cache_aware@store"]["note"]
    assert by_target["direct"]["+p50 c1 ms"] == "(1.00)"  # the baseline shows its absolute latency
    assert by_target["vllm-router round_robin"]["note"] == "pip install failed"
    assert by_target["kvgate cache_aware@store"]["note"].startswith("tokenize stage 42 ms/req")
    document = results_json(RoutersConfig(trace="t.jsonl"), [direct, routed, missing])
    assert document["results"][1]["overhead"]["1"]["added_p50_ms"] == pytest.approx(0.5)
    assert document["results"][2]["status"] == "unavailable"
    assert document["results"][1]["ideal_hit_ratio"] == 0.41 and document["results"][1]["engine_hit_ratio"] == 0.375


def test_plot_writes_a_png(tmp_path):
    path = tmp_path / "img" / "routers.png"
    plot(sample_results(), (1, 32), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_real_engines_missing_say_how_to_install(capsys, monkeypatch, tmp_path):
    """Without the engines' virtualenv the run stops before any replay, naming the install command."""
    from kvgate.config.engines import ENGINES_HOME_ENV
    from kvgate.engines.install import INSTALL_COMMAND

    monkeypatch.setenv(ENGINES_HOME_ENV, str(tmp_path / "no-engines"))
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n')
    args = routers_args("--engines-kind", "vllm", "--targets", "kvgate:cache_aware", "--log-dir", str(tmp_path / "logs"))
    args.trace = str(trace)
    assert routers_run(args) == 1
    assert f"run `{INSTALL_COMMAND}`" in capsys.readouterr().err
