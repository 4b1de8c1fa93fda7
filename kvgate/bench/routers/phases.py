"""The two phases every target goes through (trace replay, overhead), target after target."""

from __future__ import annotations

import json
import multiprocessing
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from kvgate.bench import peers
from kvgate.bench.loadgen import OVERHEAD_PROMPT, closed_loop_in_process, in_own_process
from kvgate.bench.replay import ReplayConfig, replay_in_process
from kvgate.bench.routers.processes import Engine, cpu_split, instant_backends, mock_engines, pinned, router
from kvgate.bench.routers.targets import (
    DIRECT,
    ENGINE_BLOCK_TOKENS,
    KVGATE,
    MODEL,
    RoutersConfig,
    Target,
    TargetResult,
)
from kvgate.kvs_client.launch import start_redis_server
from kvgate.processes import ServiceStartError
from kvgate.simulator.trace import read_trace


def log(message: str) -> None:
    print(f"[routers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _replay_phase(config: RoutersConfig, base_url: str, result: TargetResult, budget_s: float) -> None:
    replay_config = ReplayConfig(
        url=base_url, trace=config.trace, speedup=config.speedup, limit=config.limit,
        max_tokens_cap=config.max_tokens_cap, model=MODEL, prompt_format="text",
        tokenizer=config.tokenizer, engine_block_tokens=ENGINE_BLOCK_TOKENS, timeout_s=120.0, progress=True,
    )
    report = in_own_process(replay_in_process, replay_config, timeout_s=budget_s)
    result.replay = report.summary
    result.ttfts_s = report.ttfts_s


def _metric_families(base_url: str):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5.0) as response:
        return list(text_string_to_metric_families(response.read().decode()))


def engine_prompt_tokens(engine: Engine) -> int:
    """The engine's vllm:prefix_cache_queries_total (prompt tokens it looked up), from /metrics."""
    for family in _metric_families(engine.url):
        if family.name == "vllm:prefix_cache_queries":
            return int(sum(sample.value for sample in family.samples if sample.name.endswith("_total")))
    raise RuntimeError(f"{engine.url}/metrics has no vllm:prefix_cache_queries_total")


def gateway_stage_ms(gateway_url: str) -> dict[str, float]:
    """Mean milliseconds per request of each stage of kvgate's kvgate_stage_seconds histogram."""
    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    for family in _metric_families(gateway_url):
        if family.name == "kvgate_stage_seconds":
            for sample in family.samples:
                stage = sample.labels.get("stage", "")
                if sample.name.endswith("_sum"):
                    sums[stage] = sample.value
                elif sample.name.endswith("_count"):
                    counts[stage] = sample.value
    return {stage: sums[stage] / counts[stage] * 1000 for stage in sums if counts.get(stage)}


def serves_tokenize(engine: Engine) -> bool:
    """Whether the engine answers vLLM's POST /tokenize (vllm-router's cache_aware asks every worker)."""
    body = json.dumps({"model": MODEL, "prompt": "probe"}).encode()
    request = urllib.request.Request(f"{engine.url}/tokenize", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5.0) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def _overhead_phase(config: RoutersConfig, base_url: str, result: TargetResult) -> None:
    body = json.dumps({"model": MODEL, "prompt": OVERHEAD_PROMPT, "max_tokens": 1,
                       "stream": False}).encode()
    for concurrency in config.overhead_concurrency:
        result.overhead[concurrency] = in_own_process(
            closed_loop_in_process, f"{base_url}/v1/completions", body, concurrency,
            config.overhead_duration_s, config.overhead_max_requests,
            timeout_s=config.overhead_duration_s + 60.0,
        )


def _unavailable_reason(target: Target, env: peers.PeerEnvironment) -> str | None:
    if target.router in peers.PEER_VERSIONS:
        return env.unavailable.get(target.router)
    return None


def run_targets(config: RoutersConfig, log_dir: Path) -> list[TargetResult]:
    needed = sorted({t.router for t in config.targets if t.router in peers.PEER_VERSIONS})
    env = peers.ensure_peers(config.venv_dir, {p: peers.PEER_VERSIONS[p] for p in needed}, log=log,
                             install=config.install_peers)
    records = read_trace(config.trace, limit=config.limit)
    # The compressed span of the replay, plus time to build the prompts and drain the last requests.
    replay_budget_s = (records[-1].arrival_s - records[0].arrival_s) / config.speedup + 300.0
    split = cpu_split() if config.pin_cpus else None
    router_cpus, other_cpus = split if split else (None, None)
    results = []
    with start_redis_server(log_dir) as redis, instant_backends(config.overhead_backends, log_dir) as fast:
        for number, target in enumerate(config.targets, start=1):
            result = TargetResult(target)
            results.append(result)
            reason = _unavailable_reason(target, env)
            if reason:
                result.status, result.reason = "unavailable", reason
                log(f"[{number}/{len(config.targets)}] {target.label}: unavailable: {reason}")
                continue
            try:
                if target.router != DIRECT:
                    log(f"[{number}/{len(config.targets)}] {target.label}: replay on {config.engines} cold engines")
                    _flush(redis.url)
                    with pinned(other_cpus), mock_engines(config, redis.url, log_dir) as engines, \
                            router(target, engines, env, redis.url, config.tokenizer, log_dir, "replay",
                                   router_cpus) as routed:
                        _replay_phase(config, routed.url, result, replay_budget_s)
                        result.engine_prompt_tokens = tuple(engine_prompt_tokens(e) for e in engines)
                        if target.router == KVGATE:
                            result.gateway_stage_ms = gateway_stage_ms(routed.url)
                        if target == Target("vllm-router", "cache_aware") and not serves_tokenize(engines[0]):
                            result.notes.append("engines answer 404 to /tokenize: its tree works without token ids")
                log(f"[{number}/{len(config.targets)}] {target.label}: overhead")
                with router(target, fast, env, redis.url, config.tokenizer, log_dir, "overhead") as routed:
                    _overhead_phase(config, routed.url, result)
                result.load_average = os.getloadavg()
            except (ServiceStartError, multiprocessing.TimeoutError, OSError, RuntimeError) as exc:
                result.status = "failed"
                result.reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log(f"{target.label}: failed: {exc}")
    return results


def _flush(redis_url: str) -> None:
    """Cold start for the next target: no block claims left over from the previous one."""
    import redis as redis_sync

    client = redis_sync.Redis.from_url(redis_url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()
