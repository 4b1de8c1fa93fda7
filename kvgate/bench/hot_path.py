"""`kvgate bench hot-path`: what each stage of the cache-aware path costs one request, stage by stage.

The ~2 KB (~400-token) completion of `kvgate bench overhead`, with the cache-aware threshold below
its length, through the gateway's own parts called directly (no HTTP): parse the body, tokenize
(warm prefix cache, as for a repeated system prompt), hash the blocks and build the store keys,
look them up (embedded index behind the resilience wrapper), load the candidates from the account
and decide, record the dispatch in the account and release it, and the metric updates a request
makes. Each stage is timed call by call; medians and p99 in microseconds. With --whole-plan, a
last row times the whole plan (`RoutePlanner.plan` as a served request runs it: tokenize, hash,
look up, candidates, decide, with their stage metrics) in a gateway built as `kvgate serve` builds
it. What is not here is the HTTP server and client (aiohttp), the rest of `kvgate bench overhead`'s
CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import orjson
from prometheus_client import CollectorRegistry
from tabulate import tabulate

from kvgate.bench.decision import time_calls
from kvgate.bench.loadgen import OVERHEAD_PROMPT, LatencyStats
from kvgate.bench.routers.targets import OVERHEAD_CACHE_AWARE_MIN_TOKENS
from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.http.app import build_app
from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer
from kvgate.gateway.protocol import parse_completion
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient
from kvgate.metrics.definitions import gateway_metrics, kvs_metrics
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import Candidate

T = TypeVar("T")


def _settings(instances: int) -> Settings:
    configs = [InstanceConfig(id=f"i{n}", url=f"http://127.0.0.1:{9000 + n}", model="m") for n in range(instances)]
    return Settings(dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=OVERHEAD_CACHE_AWARE_MIN_TOKENS,
                    kvs_backend="embedded", instances=configs)


def _stages(instances: int) -> list[tuple[str, Callable[[], object]]]:
    settings = _settings(instances)
    configs = settings.instances
    body = orjson.dumps({"model": "m", "prompt": OVERHEAD_PROMPT, "max_tokens": 1})
    tokenizer = TokenizerService(load_tokenizer())
    ids = tokenizer.encode_prompt_sync(OVERHEAD_PROMPT)
    scheduler = Scheduler(settings, configs)
    blocks = scheduler.block_hashes(ids)
    keys = scheduler.block_keys(blocks)
    registry = CollectorRegistry()
    kvs = ResilientKVSClient(EmbeddedKVSIndex(), settings, kvs_metrics(registry))
    loop = asyncio.new_event_loop()
    account = LoadAccount(600)
    metrics = gateway_metrics(registry)
    stage = {name: metrics.stage_seconds.labels(name) for name in ("tokenize", "kvs", "schedule")}
    requests_ok = metrics.requests.labels("/v1/completions", "200")

    def decide() -> object:
        candidates = [Candidate(c.id, c.role, account.load(c.id)) for c in configs]
        return scheduler.decide(len(ids), blocks, [()] * len(blocks), candidates)

    def account_round() -> None:
        account.dispatch("r", "i0", len(ids), time.monotonic())
        account.first_token("r", time.monotonic())
        account.release("r")

    def metric_updates() -> None:
        for child in stage.values():
            child.observe(0.0001)
        metrics.ttft_seconds.observe(0.001)
        metrics.e2e_seconds.observe(0.001)
        metrics.prefix_hit_ratio.observe(0.0)
        requests_ok.inc()

    return [
        ("parse", lambda: parse_completion(body)),
        ("tokenize (warm cache)", lambda: tokenizer.encode_prompt_sync(OVERHEAD_PROMPT)),
        ("hash + keys", lambda: scheduler.block_keys(scheduler.block_hashes(ids))),
        ("store lookup (embedded)", lambda: loop.run_until_complete(kvs.lookup(keys))),
        (f"candidates + decide ({instances} instances)", decide),
        ("account: dispatch, first token, release", account_round),
        ("metric updates (gateway's 7)", metric_updates),
    ]


def _completed(coroutine: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends, stepped once by hand: an event-loop round
    trip per call (~7 us) would be most of what is measured. The planner with the embedded index
    and a short prompt never suspends (nothing is waited for); if it did, this says so."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("the plan suspended: this benchmark needs the inline path")


async def _time_plans(instances: int, repeats: int, max_seconds: float) -> LatencyStats:
    """RoutePlanner.plan over the prompt, in a gateway built as `kvgate serve` builds it (run inside
    a running loop: the planner reads it)."""
    gateway = build_app(_settings(instances), kvs_index=EmbeddedKVSIndex(), tokenizer=load_tokenizer())[GATEWAY]
    request = parse_completion(orjson.dumps({"model": "m", "prompt": OVERHEAD_PROMPT, "max_tokens": 1}))
    return time_calls(lambda: _completed(gateway.planner.plan(request)), repeats, max_seconds)


def run(args: argparse.Namespace) -> int:
    rows = []
    for name, call in _stages(args.instances):
        stats = time_calls(call, args.repeats, args.max_seconds)
        rows.append([name, f"{stats.p50 * 1e6:.1f}", f"{stats.p99 * 1e6:.1f}", stats.count])
    if getattr(args, "whole_plan", False):  # callers building their own Namespace may leave it out
        stats = asyncio.run(_time_plans(args.instances, args.repeats, args.max_seconds))
        rows.append(["whole plan (RoutePlanner.plan)", f"{stats.p50 * 1e6:.1f}", f"{stats.p99 * 1e6:.1f}",
                     stats.count])
    print(f"cache-aware path of a {len(OVERHEAD_PROMPT)}-character completion, stage by stage (microseconds)")
    print(tabulate(rows, headers=["stage", "median us", "p99 us", "calls"], tablefmt="github"))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("hot-path", help="cost of each stage of the cache-aware path for one request",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8, help="candidate instances (default 8)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls per stage (default 2000)")
    parser.add_argument("--max-seconds", type=float, default=3.0, help="time cap per stage (default 3)")
    parser.add_argument("--whole-plan", action="store_true",
                        help="also time RoutePlanner.plan whole, in a gateway built as `kvgate serve` builds it")
    parser.set_defaults(func=run)
