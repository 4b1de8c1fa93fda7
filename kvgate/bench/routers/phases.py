"""The two phases every target goes through (trace replay, overhead), target after target."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from kvgate.bench import peers
from kvgate.bench.loadgen import OVERHEAD_PROMPT, closed_loop_in_process, in_own_process
from kvgate.bench.replay import ReplayConfig, replay_in_process
from kvgate.bench.routers.processes import (
    Engine,
    RealFleet,
    cpu_split,
    instant_backends,
    mock_engines,
    pinned,
    router,
    vllm_engines,
)
from kvgate.bench.routers.targets import (
    DIRECT,
    ENGINE_BLOCK_TOKENS,
    KVGATE,
    MODEL,
    RoutersConfig,
    Target,
    TargetResult,
)
from kvgate.bench.routers.trace_slice import TraceSlice
from kvgate.engines.vllm import PrefixCacheCounters, fleet_hit_ratio, read_prefix_cache_counters
from kvgate.kvs_client.launch import start_redis_server
from kvgate.processes import ServiceStartError


def log(message: str) -> None:
    print(f"[routers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _replay_phase(config: RoutersConfig, trace: TraceSlice, base_url: str, result: TargetResult,
                  budget_s: float) -> None:
    replay_config = ReplayConfig(
        url=base_url, trace=str(trace.path), speedup=config.speedup, limit=None,
        max_tokens_cap=config.max_tokens_cap, model=config.model, prompt_format="text",
        tokenizer=config.tokenizer, engine_block_tokens=ENGINE_BLOCK_TOKENS, timeout_s=120.0, progress=True,
    )
    report = in_own_process(replay_in_process, replay_config, timeout_s=budget_s)
    result.replay = report.summary
    result.ttfts_s = report.ttfts_s
    result.ideal_hit_ratio = report.ideal_hit_ratio


def _metric_families(base_url: str):
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5.0) as response:
        return list(text_string_to_metric_families(response.read().decode()))


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


def gateway_hit_comparisons(gateway_url: str) -> dict[str, int]:
    """kvgate's closed-loop hit accounting, summed over instances: answers whose engine-reported cached
    tokens agreed with the hit the cache view predicted (within one chunk), or were higher or lower."""
    outcomes: dict[str, int] = {}
    for family in _metric_families(gateway_url):
        if family.name == "kvgate_hit_comparisons":
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    outcome = sample.labels.get("outcome", "")
                    outcomes[outcome] = outcomes.get(outcome, 0) + int(sample.value)
    return outcomes


def serves_tokenize(engine: Engine, model: str = MODEL) -> bool:
    """Whether the engine answers vLLM's POST /tokenize (vllm-router's cache_aware asks every worker)."""
    body = json.dumps({"model": model, "prompt": "probe"}).encode()
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


def unavailable_reason(target: Target, env: peers.PeerEnvironment, config: RoutersConfig) -> str | None:
    if target.router in peers.PEER_VERSIONS:
        return env.unavailable.get(target.router)
    if target.reads_store and not config.has_store:
        return f"{target.label} routes on the store index; real vLLM engines publish to no store: use @events"
    return None


@contextlib.contextmanager
def _replay_engines(config: RoutersConfig, redis_url: str, log_dir: Path,
                    real: RealFleet | None) -> Iterator[list[Engine]]:
    """Cold engines for one target: fresh mock engines, or the real ones with their caches emptied."""
    if real is None:
        _flush(redis_url)
        with mock_engines(config, redis_url, log_dir) as engines:
            yield engines
        return
    real.reset()
    yield real.engines


def engines_figures(result: TargetResult, before: list[PrefixCacheCounters],
                    after: list[PrefixCacheCounters]) -> None:
    """The engines' own counters over the replay: each one's prompt tokens (the spread), the hit ratio."""
    result.engine_prompt_tokens = tuple(int(a.queries - b.queries) for a, b in zip(after, before, strict=True))
    result.engine_hit_ratio = fleet_hit_ratio(before, after)


def run_targets(config: RoutersConfig, trace: TraceSlice, log_dir: Path) -> list[TargetResult]:
    needed = sorted({t.router for t in config.targets if t.router in peers.PEER_VERSIONS})
    env = peers.ensure_peers(config.venv_dir, {p: peers.PEER_VERSIONS[p] for p in needed}, log=log,
                             install=config.install_peers)
    requests = trace.requests
    # The compressed span of the replay, plus time to build the prompts and drain the last requests.
    replay_budget_s = (requests[-1].arrival_s - requests[0].arrival_s) / config.speedup + 300.0
    # Real engines are pinned to their own cores (VLLMEngineSpec.core): nothing to split.
    split = cpu_split() if config.pin_cpus and config.engines_kind == "mock" else None
    router_cpus, other_cpus = split if split else (None, None)
    results = []
    with contextlib.ExitStack() as stack:
        # The store only kvgate asks shares the router's core(s), not the engines': a Redis starved by the
        # engines' CPU work misses kvgate's lookup budget and is marked down (routing blind meanwhile).
        with pinned(router_cpus):
            redis = stack.enter_context(start_redis_server(log_dir))
        fast = stack.enter_context(instant_backends(config.overhead_backends, log_dir))
        real = None
        if config.engines_kind == "vllm" and any(unavailable_reason(t, env, config) is None
                                                 and t.router != DIRECT for t in config.targets):
            log(f"starting {config.engines} real vLLM engines (about a minute)")
            real = stack.enter_context(vllm_engines(config, log_dir))
        matching = real.gateway_settings if real else None
        for number, target in enumerate(config.targets, start=1):
            result = TargetResult(target)
            results.append(result)
            reason = unavailable_reason(target, env, config)
            if reason:
                result.status, result.reason = "unavailable", reason
                log(f"[{number}/{len(config.targets)}] {target.label}: unavailable: {reason}")
                continue
            try:
                if target.router != DIRECT:
                    log(f"[{number}/{len(config.targets)}] {target.label}: replay on {config.engines} cold engines")
                    with pinned(other_cpus), _replay_engines(config, redis.url, log_dir, real) as engines, \
                            router(target, engines, env, redis.url, config.tokenizer, log_dir, "replay",
                                   router_cpus, config.model, matching) as routed:
                        before = [read_prefix_cache_counters(e.url) for e in engines]
                        _replay_phase(config, trace, routed.url, result, replay_budget_s)
                        engines_figures(result, before, [read_prefix_cache_counters(e.url) for e in engines])
                        if target.router == KVGATE:
                            result.gateway_stage_ms = gateway_stage_ms(routed.url)
                            result.hit_comparisons = gateway_hit_comparisons(routed.url)
                        if target == Target("vllm-router", "cache_aware") and not serves_tokenize(
                                engines[0], config.model):
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
