"""`kvgate bench kvs`: how long one KV store lookup takes, by backend and number of keys.

Starts a real `mooncake_master` on loopback, stores keys from two store clients on 127.0.0.2
and 127.0.0.3 (child processes, as engines would), then times `ResilientKVSClient.lookup`, the
exact call the gateway makes, for lookups of 16, 512 and 4096 keys (a 4K-, 128K- and 1M-token
prompt at 256 tokens per block). Key strings have the Llumnix shape (64 hex digits + "_0") and
a quarter of the asked keys are absent, as in a partial prefix hit.

Baselines measured in the same run:
- http-only: the same master answering one GET of all keys, read but not parsed: the floor any
  client pays; kvgate's own cost is the difference;
- mooncake-1req: the same master, the whole key list in one request (no URL-size split);
- redis: the Redis index on a real redis-server (when the binary is installed);
- embedded: the in-process index, i.e. the client's own cost without any network.

The variants are measured interleaved (one call of each in turn, the order rotating), so a busy
machine slows them alike and the differences stay meaningful. Calls are sequential (latency, not throughput);
repeats are bounded in count and time.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote

import aiohttp
from tabulate import tabulate
from yarl import URL

from kvgate.bench.loadgen import LatencyStats, run_async
from kvgate.config.settings import KVSBackendName, Settings
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient, make_kvs_client
from kvgate.kvs_client.launch import (
    MooncakeMasterProcess,
    RedisServerProcess,
    mooncake_master_binary,
    redis_server_binary,
    start_mooncake_master,
    start_redis_server,
)
from kvgate.kvs_client.mooncake import QUERY_PATH, MooncakeMasterBackend
from kvgate.kvs_client.publisher_process import PublisherProcess
from kvgate.kvs_client.redis_index import RedisBlockPublisher

HOLDER_IPS = ("127.0.0.2", "127.0.0.3")
ABSENT_EVERY = 4  # one asked key in four is held nowhere
WARMUP_CALLS = 5
# Generous: the benchmark measures the store, so the budget must never cut a lookup short.
BENCH_SETTINGS = Settings(kvs_query_budget_ms=10_000, kvs_retry_times=0)

# One timed call: returns (succeeded, hits), hits None where the answer is not parsed.
Call = Callable[[Sequence[str]], Awaitable[tuple[bool, int | None]]]


@dataclass
class Variant:
    name: str
    call: Call
    requests: Callable[[Sequence[str]], int] = lambda keys: 1


@dataclass
class Row:
    variant: str
    keys: int
    requests_per_lookup: int
    latencies: list[float] = field(default_factory=list)
    errors: int = 0
    hits: int | None = None


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


def lookup_variant(name: str, client: ResilientKVSClient) -> Variant:
    async def call(keys: Sequence[str]) -> tuple[bool, int | None]:
        result = await client.lookup(keys)
        return result.status == "ok", result.hit_count

    backend = client.backend
    if isinstance(backend, MooncakeMasterBackend):
        return Variant(name, call, lambda keys: len(backend.plan_requests(keys)))
    return Variant(name, call)


def http_only_variant(session: aiohttp.ClientSession, admin_url: str) -> Variant:
    async def call(keys: Sequence[str]) -> tuple[bool, int | None]:
        url = URL(f"{admin_url}{QUERY_PATH}?keys=" + ",".join(quote(key, safe="") for key in keys), encoded=True)
        async with session.get(url) as response:
            await response.read()
            return response.status == 200, None

    return Variant("http-only", call)


async def measure(variants: Sequence[Variant], sizes: Sequence[int], repeats: int, max_s: float) -> list[Row]:
    rows: list[Row] = []
    for size in sizes:
        asked, _ = asked_and_held(size)
        size_rows = [Row(v.name, size, v.requests(asked)) for v in variants]
        for variant in variants:
            for _ in range(WARMUP_CALLS):
                await variant.call(asked)
        stop_at = time.perf_counter() + max_s
        pairs = list(zip(variants, size_rows, strict=True))
        for round_index in range(repeats):
            if time.perf_counter() >= stop_at:
                break
            # Rotate who goes first: the first call after another server's turn pays wake-up costs.
            shift = round_index % len(pairs)
            for variant, row in pairs[shift:] + pairs[:shift]:
                started = time.perf_counter()
                ok, row.hits = await variant.call(asked)
                row.latencies.append(time.perf_counter() - started)
                row.errors += not ok
        rows += size_rows
    return rows


def mooncake_settings(master: MooncakeMasterProcess, **overrides) -> Settings:
    host, port = master.admin_url.removeprefix("http://").split(":")
    return BENCH_SETTINGS.model_copy(update={
        "kvs_backend": KVSBackendName.MOONCAKE,
        "kvs_metadata_service_http_server_host": host,
        "kvs_metadata_service_http_server_port": int(port),
        **overrides,
    })


def fill_mooncake(stack: contextlib.ExitStack, master: MooncakeMasterProcess, sizes: Sequence[int], work_dir: Path) -> None:
    holders = [
        stack.enter_context(PublisherProcess(ip, master.rpc_address, master.metadata_url, work_dir / f"holder-{ip}.log"))
        for ip in HOLDER_IPS
    ]
    for size in sizes:
        for holder, keys in zip(holders, asked_and_held(size)[1], strict=True):
            failed = holder.publish(keys)
            if failed:
                raise RuntimeError(f"{holder.endpoint} could not store {len(failed)} keys")


async def fill_redis(server: RedisServerProcess, prefix: str, sizes: Sequence[int]) -> None:
    for size in sizes:
        for ip, keys in zip(HOLDER_IPS, asked_and_held(size)[1], strict=True):
            publisher = RedisBlockPublisher(server.url, prefix, f"{ip}:17901", ttl_s=3600)
            await publisher.publish(keys)
            await publisher.close(withdraw=False)  # the claims are what is measured


def fill_embedded(sizes: Sequence[int]) -> EmbeddedKVSIndex:
    index = EmbeddedKVSIndex()
    for size in sizes:
        for ip, keys in zip(HOLDER_IPS, asked_and_held(size)[1], strict=True):
            index.add(keys, f"{ip}:17901")
    return index


def run_all(wanted: set[str], sizes: Sequence[int], repeats: int, max_s: float, work_dir: Path) -> list[Row]:
    with contextlib.ExitStack() as stack:
        master = redis = None
        if "mooncake" in wanted:
            master = stack.enter_context(start_mooncake_master(work_dir))
            fill_mooncake(stack, master, sizes, work_dir)
        if "redis" in wanted:
            redis = stack.enter_context(start_redis_server(work_dir))

        async def main() -> list[Row]:
            clients: list[ResilientKVSClient] = []
            variants: list[Variant] = []
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
                if master is not None:
                    default = make_kvs_client(mooncake_settings(master))
                    one_request = make_kvs_client(mooncake_settings(master, kvs_batch_query_max_url_bytes=1 << 30))
                    clients += [default, one_request]
                    variants += [http_only_variant(session, master.admin_url),
                                 lookup_variant("mooncake", default), lookup_variant("mooncake-1req", one_request)]
                if redis is not None:
                    settings = BENCH_SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.REDIS,
                                                                 "kvs_redis_url": redis.url})
                    await fill_redis(redis, settings.kvs_redis_key_prefix, sizes)
                    clients.append(make_kvs_client(settings))
                    variants.append(lookup_variant("redis", clients[-1]))
                if "embedded" in wanted:
                    settings = BENCH_SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.EMBEDDED})
                    clients.append(make_kvs_client(settings, embedded_index=fill_embedded(sizes)))
                    variants.append(lookup_variant("embedded", clients[-1]))
                try:
                    return await measure(variants, sizes, repeats, max_s)
                finally:
                    for client in clients:
                        await client.close()

        return run_async(main)


def render(rows: Sequence[Row]) -> str:
    table = []
    for row in rows:
        stats = LatencyStats.of(row.latencies)
        assert stats is not None
        hits = "-" if row.hits is None else f"{row.hits}/{row.keys}"
        table.append([row.variant, row.keys, row.requests_per_lookup, hits, row.errors, stats.count,
                      f"{stats.p50 * 1000:.3f}", f"{stats.p99 * 1000:.3f}", f"{stats.mean * 1000:.3f}"])
    headers = ["backend", "keys", "requests/lookup", "hits", "errors", "lookups", "p50 ms", "p99 ms", "mean ms"]
    return tabulate(table, headers=headers, tablefmt="github")


def run(args: argparse.Namespace) -> int:
    sizes = [int(part) for part in args.sizes.split(",") if part.strip()]
    wanted = {part.strip() for part in args.backends.split(",") if part.strip()}
    for name, binary in (("mooncake", mooncake_master_binary()), ("redis", redis_server_binary())):
        if name in wanted and binary is None:
            print(f"skipping {name}: its server binary is not on PATH")
            wanted.discard(name)
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-kvs-") as tmp:
        rows = run_all(wanted, sizes, args.repeats, args.max_seconds, Path(tmp))
    print(f"KV store lookup latency: sequential calls, variants interleaved, up to {args.repeats} per row "
          f"(at most {args.max_seconds:.0f} s per size), {ABSENT_EVERY - 1}/{ABSENT_EVERY} of keys held; "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at the end")
    print(render(rows))
    return 0 if all(row.errors == 0 for row in rows) else 1


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "kvs", help="KV store lookup latency: real Mooncake master vs Redis vs embedded index",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--sizes", default="16,512,4096", help="keys per lookup, comma-separated")
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per row (default 200)")
    parser.add_argument("--max-seconds", type=float, default=20.0, help="time cap per lookup size (default 20)")
    parser.add_argument("--backends", default="mooncake,redis,embedded", help="which to measure")
    parser.set_defaults(func=run)
