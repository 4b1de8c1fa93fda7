"""`kvgate bench routers`: kvgate side by side with sglang-router and vllm-router, in one run.

Every target (a router with a policy, or no router at all) gets the same two phases:

1. Workload replay. Fresh mock engines (separate `kvgate mock-engine` processes, cold caches,
   publishing their blocks to a Redis index that only kvgate reads) with the router in front; a
   Mooncake trace replayed through it, time-compressed. Prompts are sent as text, because
   sglang-router refuses token-id prompts (HTTP 422); each trace token is one word that the
   engines' tokenizer encodes as one token. Figures: token-weighted hit ratio and TTFT.
2. Overhead. The router in front of instant backends (answers at once, see instant_backend);
   closed loops at concurrency 1 and 32 with a ~2 KB non-streaming one-token request. The same
   loops sent straight to one backend are the baseline: added latency = router - direct.

The load generator always runs in a process of its own. Routers and engines are processes too,
all on 127.0.0.1. Peers are installed into their own virtualenv (see peers.py); one that cannot
be installed or started is reported as unavailable with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from tabulate import tabulate

from kvgate.bench import peers
from kvgate.bench.loadgen import (
    OVERHEAD_PROMPT,
    ClosedLoopResult,
    ReplaySummary,
    closed_loop_in_process,
    in_own_process,
)
from kvgate.bench.replay import ReplayConfig, replay_in_process
from kvgate.config.settings import Settings
from kvgate.kvs_client.launch import LocalProcess, ServiceStartError, free_port, start_redis_server
from kvgate.scheduler.registry import POLICY_NAMES
from kvgate.simulator.trace import TraceError, ideal_hit_ratio, read_trace

KVGATE = "kvgate"
DIRECT = "direct"
MODEL = "kvgate/mock-llm"
_START_TIMEOUT_S = 90.0
# The mock engines run with the default --kvs-chunk-size, which is their KV block size.
ENGINE_BLOCK_TOKENS = Settings().kvs_chunk_size


@dataclass(frozen=True)
class Target:
    router: str  # kvgate | sglang-router | vllm-router | direct
    policy: str = ""

    @property
    def label(self) -> str:
        return f"{self.router} {self.policy}".strip()

    @classmethod
    def parse(cls, text: str) -> Target:
        router, _, policy = text.partition(":")
        if router == DIRECT:
            return cls(DIRECT)
        if router not in (KVGATE, *peers.PEER_VERSIONS):
            raise ValueError(f"unknown router {router!r}; choose from {[KVGATE, *peers.PEER_VERSIONS, DIRECT]}")
        # kvgate takes any of its dispatch policies (e.g. kvgate:prefix); peers the two they share.
        policies = list(POLICY_NAMES) if router == KVGATE else list(peers.PEER_POLICIES)
        if policy not in policies:
            raise ValueError(f"{text!r}: policy must be one of {policies}")
        return cls(router, policy)


DEFAULT_TARGETS = (
    Target(DIRECT),
    *(Target(router, policy) for router in (KVGATE, *peers.PEER_VERSIONS) for policy in peers.PEER_POLICIES),
)


@dataclass(frozen=True)
class RoutersConfig:
    trace: str
    engines: int = 4
    # KV blocks of 256 tokens per engine: ~3.4M tokens, an 80 GB GPU's HBM (426K tokens) plus the
    # host DRAM it lends to a KV store, as `kvgate simulate` assumes (docs/BENCHMARKS.md). With HBM
    # alone most of the trace's reuse is evicted before it comes back and no router finds hits.
    cache_capacity_blocks: int = 13312
    # speedup x time_scale = 1: the engines see the trace's real load, only faster. Kept small
    # because routers' CPU work (tokenizing, hashing) is not scaled: at 10x a tokenizing router
    # does ten times its real work per unit of engine time, on the engines' cores.
    time_scale: float = 0.25
    speedup: float = 4.0
    limit: int = 500
    max_tokens_cap: int = 32
    tokenizer: str = ""
    overhead_backends: int = 2
    overhead_concurrency: tuple[int, ...] = (1, 32)
    overhead_duration_s: float = 3.0
    overhead_max_requests: int = 200_000
    targets: tuple[Target, ...] = DEFAULT_TARGETS
    venv_dir: Path | None = None
    install_peers: bool = True
    log_dir: Path | None = None
    # Replay phase: routers on their own core(s), engines and the load generator on the others,
    # so no router's CPU work slows the engines' simulated clocks (see cpu_split).
    pin_cpus: bool = True


@dataclass
class TargetResult:
    target: Target
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    replay: ReplaySummary | None = None
    ttfts_s: tuple[float, ...] = ()
    # Prompt tokens each engine was asked to compute (its vllm:prefix_cache_queries counter): the spread.
    engine_prompt_tokens: tuple[int, ...] = ()
    # kvgate only: mean milliseconds per request in each gateway stage (tokenize, kvs, schedule).
    gateway_stage_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load_average: tuple[float, float, float] | None = None  # 1-min load when the target finished
    overhead: dict[int, ClosedLoopResult] = field(default_factory=dict)

    @property
    def load_skew(self) -> float | None:
        """Busiest engine's prompt tokens / the mean: 1.0 is an even spread."""
        tokens = self.engine_prompt_tokens
        return max(tokens) * len(tokens) / sum(tokens) if tokens and sum(tokens) else None


def log(message: str) -> None:
    print(f"[routers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --- processes ------------------------------------------------------------------------------------


def _models_listed(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=1.0) as response:
            return response.status == 200 and bool(json.loads(response.read()).get("data"))
    except (OSError, urllib.error.URLError, ValueError):
        return False


@contextlib.contextmanager
def _processes(specs: Sequence[tuple[list[str], Path, str, str]]) -> Iterator[None]:
    """Start every (argv, log, base_url, what) at once, wait until each lists its models, stop all on exit."""
    started: list[LocalProcess] = []
    try:
        for argv, log_path, _, _ in specs:
            started.append(LocalProcess(argv, log_path))
        for process, (_, _, base_url, what) in zip(started, specs, strict=True):
            process.wait_ready(lambda url=base_url: _models_listed(url), what, _START_TIMEOUT_S)
        yield
    finally:
        for process in started:
            process.stop()


def _kvgate_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


@dataclass(frozen=True)
class Engine:
    url: str
    kvs_endpoint: str  # the endpoint it claims its blocks under in Redis


@contextlib.contextmanager
def mock_engines(config: RoutersConfig, redis_url: str, log_dir: Path) -> Iterator[list[Engine]]:
    engines, specs = [], []
    for i in range(config.engines):
        port = free_port()
        endpoint = f"127.0.0.{2 + i}"
        argv = _kvgate_cli("mock-engine", "--port", str(port), "--model", MODEL, "--time-scale", str(config.time_scale),
                           "--kvs-backend", "redis", "--kvs-redis-url", redis_url, "--kvs-local-ip", endpoint)
        if config.tokenizer:
            argv += ["--tokenizer", config.tokenizer]
        argv += ["--cache-capacity-blocks", str(config.cache_capacity_blocks)]
        url = f"http://127.0.0.1:{port}"
        engines.append(Engine(url, endpoint))
        specs.append((argv, log_dir / f"engine-{i}-{port}.log", url, f"mock engine {i}"))
    with _processes(specs):
        yield engines


@contextlib.contextmanager
def instant_backends(count: int, log_dir: Path) -> Iterator[list[Engine]]:
    backends, specs = [], []
    for i in range(count):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        backends.append(Engine(url, ""))
        argv = [sys.executable, "-m", "kvgate.bench.instant_backend", "--port", str(port), "--model", MODEL]
        specs.append((argv, log_dir / f"instant-{i}-{port}.log", url, f"instant backend {i}"))
    with _processes(specs):
        yield backends


def kvgate_config(policy: str, port: int, engines: Sequence[Engine], redis_url: str, tokenizer: str) -> dict:
    """The gateway's YAML settings: the engines as instances, their Redis endpoints as kvs_endpoints."""
    config = {
        "host": "127.0.0.1",
        "port": port,
        "dispatch_policy": policy,
        "kvs_backend": "redis",
        "kvs_redis_url": redis_url,
        "instances": [
            {"id": f"engine-{i}", "url": e.url, "model": MODEL,
             "kvs_endpoints": [e.kvs_endpoint] if e.kvs_endpoint else []}
            for i, e in enumerate(engines)
        ],
    }
    if tokenizer:
        config["tokenizer"] = tokenizer
    return config


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(router CPUs, everyone else's CPUs): a quarter of the CPUs, at least one, for the router.

    None on a single CPU, where there is nothing to split.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    share = max(1, len(cpus) // 4)
    return set(cpus[:share]), set(cpus[share:])


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run this process, and every process it starts meanwhile, on `cpus` (None: unchanged)."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


@contextlib.contextmanager
def router(target: Target, engines: Sequence[Engine], env: peers.PeerEnvironment, redis_url: str,
           tokenizer: str, log_dir: Path, phase: str, cpus: set[int] | None = None) -> Iterator[str]:
    """The target in front of `engines`, on `cpus` if given; yields the base URL clients send to."""
    if target.router == DIRECT:
        yield engines[0].url
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slug = f"{target.router}-{target.policy}-{phase}"
    if target.router == KVGATE:
        config_path = log_dir / f"{slug}.yaml"
        config_path.write_text(yaml.safe_dump(kvgate_config(target.policy, port, engines, redis_url, tokenizer)))
        argv = _kvgate_cli("serve", "--config", str(config_path), "--log-level", "WARNING")
    else:
        build = peers.PEER_COMMANDS[target.router]
        argv = build(env, port=port, metrics_port=free_port(), worker_urls=[e.url for e in engines],
                     policy=target.policy)
    if cpus is not None:
        argv = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *argv]
    with _processes([(argv, log_dir / f"{slug}.log", url, target.label)]):
        yield url


# --- phases ---------------------------------------------------------------------------------------


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
                                   router_cpus) as url:
                        _replay_phase(config, url, result, replay_budget_s)
                        result.engine_prompt_tokens = tuple(engine_prompt_tokens(e) for e in engines)
                        if target.router == KVGATE:
                            result.gateway_stage_ms = gateway_stage_ms(url)
                        if target == Target("vllm-router", "cache_aware") and not serves_tokenize(engines[0]):
                            result.notes.append("engines answer 404 to /tokenize: its tree works without token ids")
                log(f"[{number}/{len(config.targets)}] {target.label}: overhead")
                with router(target, fast, env, redis.url, config.tokenizer, log_dir, "overhead") as url:
                    _overhead_phase(config, url, result)
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


# --- reporting ------------------------------------------------------------------------------------


def _direct(results: Sequence[TargetResult]) -> TargetResult | None:
    return next((r for r in results if r.target.router == DIRECT and r.status == "ok"), None)


def added_latency_ms(result: TargetResult, baseline: TargetResult | None, concurrency: int,
                     quantile: str) -> float | None:
    mine = result.overhead.get(concurrency)
    base = baseline.overhead.get(concurrency) if baseline else None
    if not mine or not base or not mine.latency or not base.latency:
        return None
    return (getattr(mine.latency, quantile) - getattr(base.latency, quantile)) * 1000


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def table_rows(results: Sequence[TargetResult], concurrency: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    baseline = _direct(results)
    top = max(concurrency)
    headers = ["target", "hit ratio", "TTFT mean ms", "TTFT P90 ms", "load skew", "errors"]
    for c in concurrency:
        headers += [f"+p50 c{c} ms", f"+p99 c{c} ms"]
    headers += [f"req/s c{top}", "note"]
    rows = []
    for r in results:
        replay = r.replay
        errors = sum(replay.errors.values()) if replay else None
        row = [
            r.target.label,
            _fmt(replay.hit_ratio if replay else None, "{:.1%}"),
            _fmt(replay.ttft.mean * 1000 if replay and replay.ttft else None, "{:.0f}"),
            _fmt(replay.ttft.p90 * 1000 if replay and replay.ttft else None, "{:.0f}"),
            _fmt(r.load_skew),
            "-" if errors is None else str(errors),
        ]
        for c in concurrency:
            if r is baseline:
                row += [_fmt(r.overhead[c].latency.p50 * 1000 if c in r.overhead else None, "({:.2f})"),
                        _fmt(r.overhead[c].latency.p99 * 1000 if c in r.overhead else None, "({:.2f})")]
            else:
                row += [_fmt(added_latency_ms(r, baseline, c, "p50")), _fmt(added_latency_ms(r, baseline, c, "p99"))]
        loop = r.overhead.get(top)
        row.append(_fmt(loop.requests_per_s if loop else None, "{:,.0f}"))
        notes = [r.reason] if r.status != "ok" else (["absolute latency (baseline)"] if r is baseline else [])
        if "tokenize" in r.gateway_stage_ms:
            notes.append(f"tokenize stage {r.gateway_stage_ms['tokenize']:.0f} ms/req")
        notes += r.notes
        if replay and replay.errors:
            notes.append(", ".join(f"{k} {v}" for k, v in replay.errors.items()))
        row.append("; ".join(notes))
        rows.append(row)
    return headers, rows


def results_json(config: RoutersConfig, results: Sequence[TargetResult]) -> dict:
    baseline = _direct(results)
    out = []
    for r in results:
        overhead = {}
        for c, loop in r.overhead.items():
            overhead[str(c)] = {
                "requests": loop.requests, "errors": loop.errors, "requests_per_s": loop.requests_per_s,
                "latency": asdict(loop.latency) if loop.latency else None,
                "added_p50_ms": added_latency_ms(r, baseline, c, "p50"),
                "added_p99_ms": added_latency_ms(r, baseline, c, "p99"),
            }
        out.append({"target": r.target.label, "status": r.status, "reason": r.reason,
                    "replay": r.replay.to_dict() if r.replay else None,
                    "engine_prompt_tokens": list(r.engine_prompt_tokens), "load_skew": r.load_skew,
                    "gateway_stage_ms": r.gateway_stage_ms, "notes": r.notes, "load_average": r.load_average,
                    "overhead": overhead})
    settings = {k: v for k, v in asdict(config).items() if k not in ("targets", "venv_dir", "log_dir")}
    return {"config": settings, "results": out}


def plot(results: Sequence[TargetResult], concurrency: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = _direct(results)
    # One colour per router, one line style per policy.
    colours = {KVGATE: "tab:blue", "sglang-router": "tab:green", "vllm-router": "tab:purple", DIRECT: "grey"}
    styles = {"cache_aware": "-", "round_robin": "--", "prefix": "-.", "least_load": ":"}
    fig, (cdf, bars, rates) = plt.subplots(1, 3, figsize=(17, 5.2))
    for r in results:
        if r.ttfts_s:
            xs = sorted(t * 1000 for t in r.ttfts_s)
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.target.label,
                     color=colours.get(r.target.router), linestyle=styles.get(r.target.policy, "-"),
                     linewidth=2.2 if r.target.router == KVGATE else 1.4)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Trace replay: TTFT CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=8)

    routed = [r for r in results if r is not baseline and r.overhead]
    width = 0.8 / max(1, 2 * len(concurrency))
    for j, c in enumerate(concurrency):
        for k, quantile in enumerate(("p50", "p99")):
            values = [added_latency_ms(r, baseline, c, quantile) or 0.0 for r in routed]
            offset = (2 * j + k) * width
            bars.bar([i + offset for i in range(len(routed))], values, width, label=f"{quantile} at c={c}")
    bars.set_xticks([i + width * (len(concurrency) - 0.5) for i in range(len(routed))])
    bars.set_xticklabels([r.target.label for r in routed], rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("added latency vs direct (ms)")
    bars.set_title("Overhead: latency added by the router")
    bars.legend(fontsize=8)
    bars.grid(True, axis="y", alpha=0.3)

    top = max(concurrency)
    with_rate = [r for r in results if top in r.overhead]
    rates.bar(range(len(with_rate)), [r.overhead[top].requests_per_s for r in with_rate],
              color=[colours.get(r.target.router) for r in with_rate])
    rates.set_xticks(range(len(with_rate)))
    rates.set_xticklabels([r.target.label for r in with_rate], rotation=30, ha="right", fontsize=8)
    rates.set_ylabel(f"requests/s at concurrency {top}")
    rates.set_title("Overhead: request rate (2 KB prompt, 1 token)")
    rates.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --- command --------------------------------------------------------------------------------------


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "routers",
        help="kvgate vs sglang-router vs vllm-router: trace replay (hit ratio, TTFT) and overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = RoutersConfig(trace="")
    parser.add_argument("--trace", required=True, help="Mooncake-format JSON-lines trace")
    parser.add_argument("--engines", type=int, default=d.engines, help=f"mock engines (default {d.engines})")
    parser.add_argument("--cache-capacity-blocks", type=int, default=d.cache_capacity_blocks,
                        help=f"KV blocks of {ENGINE_BLOCK_TOKENS} tokens per engine (default {d.cache_capacity_blocks}, ~3.4M tokens)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help=f"engines' real seconds per modelled GPU second (default {d.time_scale})")
    parser.add_argument("--speedup", type=float, default=d.speedup, help=f"trace time compression (default {d.speedup})")
    parser.add_argument("--limit", type=int, default=d.limit, help=f"first N trace requests (default {d.limit})")
    parser.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap,
                        help=f"cap on each request's output tokens (default {d.max_tokens_cap})")
    parser.add_argument("--tokenizer", default="", help="engines' and kvgate's tokenizer (default: kvgate's)")
    parser.add_argument("--overhead-duration", type=float, default=d.overhead_duration_s,
                        help=f"seconds per overhead loop (default {d.overhead_duration_s})")
    parser.add_argument("--overhead-concurrency", default=",".join(map(str, d.overhead_concurrency)),
                        help="comma-separated concurrency levels of the overhead phase")
    parser.add_argument("--targets", default=",".join(
        t.router if t.router == DIRECT else f"{t.router}:{t.policy}" for t in DEFAULT_TARGETS),
        help="comma-separated router:policy list (direct = one backend, the overhead baseline)")
    parser.add_argument("--venv", type=Path, default=None,
                        help=f"peers' virtualenv (default {peers.default_venv_dir()})")
    parser.add_argument("--no-install", action="store_true", help="use the peers' virtualenv as it is")
    parser.add_argument("--no-pin", action="store_true",
                        help="replay without giving the router its own core (see the module doc)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every process's log here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--plot", type=Path, default=None, help="write the TTFT CDF and overhead bars (PNG)")
    parser.set_defaults(func=run)


def _config_from(args: argparse.Namespace) -> RoutersConfig:
    targets = tuple(Target.parse(t.strip()) for t in args.targets.split(",") if t.strip())
    concurrency = tuple(int(c) for c in args.overhead_concurrency.split(",") if c.strip())
    if not targets or not concurrency or min(concurrency) < 1:
        raise ValueError("--targets and --overhead-concurrency need at least one entry; concurrency >= 1")
    if args.engines < 1 or args.limit < 1 or args.speedup <= 0 or args.time_scale < 0 or args.cache_capacity_blocks < 1:
        raise ValueError("--engines, --limit and --cache-capacity-blocks must be >= 1, --speedup > 0, "
                         "--time-scale >= 0")
    return RoutersConfig(
        trace=args.trace, engines=args.engines, cache_capacity_blocks=args.cache_capacity_blocks,
        time_scale=args.time_scale, speedup=args.speedup, pin_cpus=not args.no_pin,
        limit=args.limit, max_tokens_cap=args.max_tokens_cap, tokenizer=args.tokenizer,
        overhead_concurrency=concurrency, overhead_duration_s=args.overhead_duration, targets=targets,
        venv_dir=args.venv, install_peers=not args.no_install, log_dir=args.log_dir,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = _config_from(args)
    except ValueError as exc:
        print(f"kvgate bench routers: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        records = read_trace(config.trace, limit=config.limit)
    except TraceError as exc:  # an absent file too, before anything starts
        print(f"kvgate bench routers: {exc}", file=sys.stderr)
        return 2
    bound = ideal_hit_ratio(records, engine_block_tokens=ENGINE_BLOCK_TOKENS)
    with contextlib.ExitStack() as stack:
        if config.log_dir:
            config.log_dir.mkdir(parents=True, exist_ok=True)
            log_dir = config.log_dir
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-routers-")))
        results = run_targets(config, log_dir)
    headers, rows = table_rows(results, config.overhead_concurrency)
    print(tabulate(rows, headers=headers, tablefmt="github"))
    print(f"\n{config.engines} mock engines (time scale {config.time_scale}), trace {Path(config.trace).name} "
          f"first {config.limit} requests at {config.speedup}x (hit ratio bound {bound:.1%}), output capped at "
          f"{config.max_tokens_cap} tokens, {config.cache_capacity_blocks} KV blocks of {ENGINE_BLOCK_TOKENS} tokens per engine; "
          f"overhead: {len(OVERHEAD_PROMPT)} B prompt, max_tokens 1, {config.overhead_duration_s:.0f} s per "
          f"loop; run took {time.monotonic() - started:.0f} s")
    loads = [r.load_average[0] for r in results if r.load_average]
    if loads:
        print(f"1-minute load average after each target: {min(loads):.2f} .. {max(loads):.2f} "
              f"on {os.cpu_count()} CPUs (other work on the machine moves every figure)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results_json(config, results), indent=2))
    if args.plot:
        plot(results, config.overhead_concurrency, args.plot)
    return 0 if any(r.status == "ok" for r in results) else 1
