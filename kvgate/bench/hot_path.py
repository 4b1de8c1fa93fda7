"""`kvgate bench hot-path`: what each stage of the cache-aware path costs one request, stage by stage.

The ~2 KB (~400-token) completion of `kvgate bench overhead`, with the cache-aware threshold below
its length, through the gateway's own parts called directly (no HTTP): parse the body, tokenize
(warm prefix cache, as for a repeated system prompt), hash the blocks and build the store keys,
look them up (embedded index behind the resilience wrapper), load the candidates from the account
and decide, record the dispatch in the account and release it, and the metric updates a request
makes. Each stage is timed call by call; medians and p99 in microseconds. What is not here is the
HTTP server and client (aiohttp), the rest of `kvgate bench overhead`'s CPU per request.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable

import orjson
from prometheus_client import CollectorRegistry
from tabulate import tabulate

from kvgate.bench.decision import time_calls
from kvgate.bench.loadgen import OVERHEAD_PROMPT
from kvgate.bench.routers.targets import OVERHEAD_CACHE_AWARE_MIN_TOKENS
from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.protocol import parse_completion
from kvgate.gateway.tokenizer import TokenizerService, load_tokenizer
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient
from kvgate.metrics.definitions import gateway_metrics, kvs_metrics
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import Candidate


def _stages(instances: int) -> list[tuple[str, Callable[[], object]]]:
    settings = Settings(dispatch_policy="cache_aware", cache_aware_scheduling_min_tokens=OVERHEAD_CACHE_AWARE_MIN_TOKENS,
                        kvs_backend="embedded")
    configs = [InstanceConfig(id=f"i{n}", url=f"http://127.0.0.1:{9000 + n}", model="m") for n in range(instances)]
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


def run(args: argparse.Namespace) -> int:
    rows = []
    for name, call in _stages(args.instances):
        stats = time_calls(call, args.repeats, args.max_seconds)
        rows.append([name, f"{stats.p50 * 1e6:.1f}", f"{stats.p99 * 1e6:.1f}", stats.count])
    print(f"cache-aware path of a {len(OVERHEAD_PROMPT)}-character completion, stage by stage (microseconds)")
    print(tabulate(rows, headers=["stage", "median us", "p99 us", "calls"], tablefmt="github"))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("hot-path", help="cost of each stage of the cache-aware path for one request",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--instances", type=int, default=8, help="candidate instances (default 8)")
    parser.add_argument("--repeats", type=int, default=2000, help="timed calls per stage (default 2000)")
    parser.add_argument("--max-seconds", type=float, default=3.0, help="time cap per stage (default 3)")
    parser.set_defaults(func=run)
