"""`kvgate bench kvs`: how long one KV store lookup takes, by backend and number of keys.

Starts a real `mooncake_master` on loopback, stores keys from two store clients on 127.0.0.2
and 127.0.0.3 (child processes, as engines would), then times `ResilientKVSClient.lookup`, the
exact call the gateway makes, for lookups of 16, 512 and 4096 keys (a 4K-, 128K- and 1M-token
prompt at 256 tokens per block). Key strings have the Llumnix shape (64 hex digits + "_0") and
a quarter of the asked keys are absent, as in a partial prefix hit.

Baselines measured in the same run:
- mooncake-1req: the same master, the whole key list in one request (no URL-size split);
- redis: the Redis index on a real redis-server (when the binary is installed);
- embedded: the in-process index, i.e. the client's own cost without any network.

Lookups run one after another (latency, not throughput); repeats are bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tabulate import tabulate

from kvgate.bench.loadgen import LatencyStats, run_async
from kvgate.config.settings import KVSBackendName, Settings
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient, make_kvs_client
from kvgate.kvs_client.launch import (
    MooncakeMasterProcess,
    mooncake_master_binary,
    redis_server_binary,
    start_mooncake_master,
    start_redis_server,
)
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.kvs_client.publisher_process import PublisherProcess
from kvgate.kvs_client.redis_index import RedisBlockPublisher

HOLDER_IPS = ("127.0.0.2", "127.0.0.3")
ABSENT_EVERY = 4  # one asked key in four is held nowhere
WARMUP_LOOKUPS = 5
# Generous: the benchmark measures the store, so the budget must never cut a lookup short.
BENCH_SETTINGS = Settings(kvs_query_budget_ms=10_000, kvs_retry_times=0)


@dataclass(frozen=True)
class Case:
    backend: str
    keys: int
    requests_per_lookup: int
    hits: int
    errors: int
    stats: LatencyStats


def block_keys(count: int, label: str) -> list[str]:
    return [hashlib.sha256(f"{label}-{i}".encode()).hexdigest() + "_0" for i in range(count)]


def asked_and_held(size: int) -> tuple[list[str], list[list[str]]]:
    """The keys of one lookup, and which of them each holder stores (alternating, some absent)."""
    asked = block_keys(size, f"bench-{size}")
    held: list[list[str]] = [[] for _ in HOLDER_IPS]
    for i, key in enumerate(asked):
        if i % ABSENT_EVERY != ABSENT_EVERY - 1:
            held[i % len(HOLDER_IPS)].append(key)
    return asked, held


async def time_lookups(client: ResilientKVSClient, asked: Sequence[str], repeats: int, max_s: float) -> tuple[list[float], int, int]:
    for _ in range(WARMUP_LOOKUPS):
        await client.lookup(asked)
    latencies: list[float] = []
    errors = hits = 0
    stop_at = time.perf_counter() + max_s
    while len(latencies) < repeats and time.perf_counter() < stop_at:
        started = time.perf_counter()
        lookup = await client.lookup(asked)
        latencies.append(time.perf_counter() - started)
        errors += lookup.status != "ok"
        hits = lookup.hit_count
    return latencies, hits, errors


async def measure(name: str, client: ResilientKVSClient, sizes: Sequence[int], repeats: int, max_s: float) -> list[Case]:
    cases = []
    for size in sizes:
        asked, _ = asked_and_held(size)
        latencies, hits, errors = await time_lookups(client, asked, repeats, max_s)
        backend = client.backend
        requests = len(list(backend._chunks(asked))) if isinstance(backend, MooncakeMasterBackend) else 1
        cases.append(Case(name, size, requests, hits, errors, LatencyStats.of(latencies)))
    await client.close()
    return cases


def mooncake_settings(master: MooncakeMasterProcess, **overrides) -> Settings:
    host, port = master.admin_url.removeprefix("http://").split(":")
    return BENCH_SETTINGS.model_copy(update={
        "kvs_backend": KVSBackendName.MOONCAKE,
        "kvs_metadata_service_http_server_host": host,
        "kvs_metadata_service_http_server_port": int(port),
        **overrides,
    })


def run_mooncake(sizes: Sequence[int], repeats: int, max_s: float, work_dir: Path) -> list[Case]:
    with contextlib.ExitStack() as stack:
        master = stack.enter_context(start_mooncake_master(work_dir))
        holders = [
            stack.enter_context(PublisherProcess(ip, master.rpc_address, master.metadata_url,
                                                 work_dir / f"holder-{ip}.log"))
            for ip in HOLDER_IPS
        ]
        for size in sizes:
            for holder, keys in zip(holders, asked_and_held(size)[1], strict=True):
                failed = holder.publish(keys)
                if failed:
                    raise RuntimeError(f"{holder.endpoint} could not store {len(failed)} keys")
        default = make_kvs_client(mooncake_settings(master))
        one_request = make_kvs_client(mooncake_settings(master, kvs_batch_query_max_url_bytes=1 << 30))
        return run_async(lambda: _measure_all([("mooncake", default), ("mooncake-1req", one_request)],
                                              sizes, repeats, max_s))


def run_redis(sizes: Sequence[int], repeats: int, max_s: float, work_dir: Path) -> list[Case]:
    with start_redis_server(work_dir) as server:
        settings = BENCH_SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.REDIS, "kvs_redis_url": server.url})

        async def fill_and_measure() -> list[Case]:
            for size in sizes:
                for ip, keys in zip(HOLDER_IPS, asked_and_held(size)[1], strict=True):
                    publisher = RedisBlockPublisher(server.url, settings.kvs_redis_key_prefix, f"{ip}:17901", ttl_s=3600)
                    await publisher.publish(keys)
                    await publisher.close(withdraw=False)  # the claims are what is measured
            return await measure("redis", make_kvs_client(settings), sizes, repeats, max_s)

        return run_async(fill_and_measure)


def run_embedded(sizes: Sequence[int], repeats: int, max_s: float) -> list[Case]:
    index = EmbeddedKVSIndex()
    for size in sizes:
        for ip, keys in zip(HOLDER_IPS, asked_and_held(size)[1], strict=True):
            index.add(keys, f"{ip}:17901")
    settings = BENCH_SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.EMBEDDED})
    client = make_kvs_client(settings, embedded_index=index)
    return run_async(lambda: measure("embedded", client, sizes, repeats, max_s))


async def _measure_all(clients: list[tuple[str, ResilientKVSClient]], sizes, repeats, max_s) -> list[Case]:
    cases: list[Case] = []
    for name, client in clients:
        cases += await measure(name, client, sizes, repeats, max_s)
    return cases


def render(cases: Sequence[Case]) -> str:
    rows = [
        [c.backend, c.keys, c.requests_per_lookup, f"{c.hits}/{c.keys}", c.errors, c.stats.count,
         f"{c.stats.p50 * 1000:.3f}", f"{c.stats.p99 * 1000:.3f}", f"{c.stats.mean * 1000:.3f}"]
        for c in cases
    ]
    headers = ["backend", "keys", "HTTP req/lookup", "hits", "errors", "lookups", "p50 ms", "p99 ms", "mean ms"]
    return tabulate(rows, headers=headers, tablefmt="github")


def run(args: argparse.Namespace) -> int:
    sizes = [int(part) for part in args.sizes.split(",") if part.strip()]
    wanted = {part.strip() for part in args.backends.split(",") if part.strip()}
    runners: list[tuple[str, Callable[[Path], list[Case]], str | None]] = [
        ("mooncake", lambda d: run_mooncake(sizes, args.repeats, args.max_seconds, d),
         None if mooncake_master_binary() else "mooncake_master not on PATH"),
        ("redis", lambda d: run_redis(sizes, args.repeats, args.max_seconds, d),
         None if redis_server_binary() else "redis-server not on PATH"),
        ("embedded", lambda d: run_embedded(sizes, args.repeats, args.max_seconds), None),
    ]
    cases: list[Case] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-kvs-") as tmp:
        for name, runner, missing in runners:
            if name not in wanted:
                continue
            if missing:
                print(f"skipping {name}: {missing}")
                continue
            print(f"measuring {name} ...", flush=True)
            cases += runner(Path(tmp) / name)
    print()
    print(f"KV store lookup latency, sequential lookups, {args.repeats} repeats per row "
          f"(at most {args.max_seconds:.0f} s), {ABSENT_EVERY - 1}/{ABSENT_EVERY} of keys held; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print(render(cases))
    return 0 if all(case.errors == 0 for case in cases) else 1


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "kvs", help="KV store lookup latency: real Mooncake master vs Redis vs embedded index",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="16,512,4096", help="keys per lookup, comma-separated")
    parser.add_argument("--repeats", type=int, default=300, help="timed lookups per row (default 300)")
    parser.add_argument("--max-seconds", type=float, default=10.0, help="time cap per row (default 10)")
    parser.add_argument("--backends", default="mooncake,redis,embedded", help="which to measure")
    parser.set_defaults(func=run)

