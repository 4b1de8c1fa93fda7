"""`kvgate bench decision`: what the scheduler spends on one request with a 128K-token prompt.

Hashing: each algorithm over the prompt (512 chunks of 256 tokens), store keys included.
Baseline in the same run: the sha256_cbor chain with every chunk encoded by cbor2 itself (the
plain definition the fast encoder is checked against).

Selection: 8, 128 and 1024 candidate instances with a hit map shaped like a busy fleet: half the
instances hold a shared 2K-token system prompt, a few hold one conversation's prefix at various
lengths (16..512 chunks), loads are random. Rows per fleet size:
- round_robin select: the floor (no metrics, only the ranking and the tie cursor);
- least_load / cache_aware select: the policy alone, hits given;
- prefix hits: store endpoints -> contiguous hit tokens per instance;
- decide (cache_aware): hits + policy, what the gateway calls after the store answers.

Each row is timed call by call, bounded in repeats and seconds; median and p99 are printed.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable

from tabulate import tabulate

from kvgate.bench.loadgen import LatencyStats
from kvgate.config.settings import HashAlgo, InstanceConfig, InstanceRole, Settings
from kvgate.scheduler.hashing import BlockHash, hash_sha256_cbor_with_cbor2
from kvgate.scheduler.prefix import prefix_hit_tokens
from kvgate.scheduler.registry import make_policy
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import Candidate, InstanceLoad, RoutingRequest

PROMPT_TOKENS = 131072
CHUNK = 256
VOCAB = 129280  # DeepSeek-V3's vocabulary: ids need 1, 2, 3 and 5 CBOR bytes
FLEET_SIZES = (8, 128, 1024)
SYSTEM_PROMPT_CHUNKS = 8
WARMUP_CALLS = 3


def time_calls(call: Callable[[], object], repeats: int, max_s: float) -> LatencyStats:
    for _ in range(WARMUP_CALLS):
        call()
    samples: list[float] = []
    stop_at = time.perf_counter() + max_s
    while len(samples) < repeats and time.perf_counter() < stop_at:
        started = time.perf_counter()
        call()
        samples.append(time.perf_counter() - started)
    stats = LatencyStats.of(samples)
    assert stats is not None
    return stats


def fleet(size: int, rng: random.Random) -> tuple[list[InstanceConfig], list[Candidate]]:
    instances = [
        InstanceConfig(
            id=f"inst-{n:04d}",
            url=f"http://127.0.0.1:{20000 + n}",
            model="bench",
            kvs_endpoints=(f"127.0.{n // 250}.{n % 250 + 2}",),
        )
        for n in range(size)
    ]
    candidates = [
        Candidate(
            inst.id,
            InstanceRole.NEUTRAL,
            InstanceLoad(
                num_requests=rng.randrange(0, 16),
                num_waiting_requests=rng.randrange(0, 4),
                all_prefills_tokens_num=rng.randrange(0, 8) * 4096,
                kv_cache_usage_ratio=round(rng.random(), 2),
            ),
        )
        for inst in instances
    ]
    return instances, candidates


def hit_map(instances: list[InstanceConfig], num_chunks: int, rng: random.Random) -> list[set[str]]:
    """Store endpoints holding each chunk: a shared system prompt, and one conversation's prefix."""
    held_chunks: dict[str, int] = {}
    for inst in instances:
        if rng.random() < 0.5:
            held_chunks[inst.kvs_endpoints[0]] = SYSTEM_PROMPT_CHUNKS
    for inst in rng.sample(instances, min(4, len(instances))):
        held_chunks[inst.kvs_endpoints[0]] = rng.randrange(16, num_chunks + 1)
    return [{f"{ip}:17901" for ip, chunks in held_chunks.items() if chunks > i} for i in range(num_chunks)]


def hashing_rows(tokens: list[int], repeats: int, max_s: float) -> list[list[str]]:
    rows = []
    for algo in HashAlgo:
        scheduler = Scheduler(Settings(kvs_hash_algo=algo, kvs_chunk_size=CHUNK), ())
        stats = time_calls(lambda s=scheduler: s.block_keys(s.block_hashes(tokens)), repeats, max_s)
        rows.append([f"{algo.value} (+ keys)", *_ms(stats)])
    plain = time_calls(lambda: hash_sha256_cbor_with_cbor2(tokens, CHUNK, False, "0"), repeats, max_s)
    rows.append(["baseline: sha256_cbor, cbor2 per chunk", *_ms(plain)])
    return rows


def selection_rows(size: int, repeats: int, max_s: float, rng: random.Random) -> list[list[str]]:
    instances, candidates = fleet(size, rng)
    settings = Settings(dispatch_policy="cache_aware", kvs_chunk_size=CHUNK)
    scheduler = Scheduler(settings, instances, rng=random.Random(0))
    blocks = [BlockHash(f"{i:064x}", CHUNK, True) for i in range(PROMPT_TOKENS // CHUNK)]
    locations = hit_map(instances, len(blocks), rng)
    hits = prefix_hit_tokens(blocks, locations, scheduler.endpoint_map, PROMPT_TOKENS)
    request = RoutingRequest(PROMPT_TOKENS, hits)
    rows = []
    for name in ("round_robin", "least_load", "cache_aware"):
        policy = make_policy(Settings(dispatch_policy=name), random.Random(0))
        stats = time_calls(lambda p=policy: p.select(request, candidates), repeats, max_s)
        rows.append([size, f"{name} select", len(hits), *_ms(stats)])
    stats = time_calls(
        lambda: prefix_hit_tokens(blocks, locations, scheduler.endpoint_map, PROMPT_TOKENS), repeats, max_s
    )
    rows.append([size, "prefix hits", len(hits), *_ms(stats)])
    stats = time_calls(lambda: scheduler.decide(PROMPT_TOKENS, blocks, locations, candidates), repeats, max_s)
    rows.append([size, "decide (cache_aware)", len(hits), *_ms(stats)])
    return rows


def _ms(stats: LatencyStats) -> list[str]:
    return [f"{stats.p50 * 1000:.3f}", f"{stats.p99 * 1000:.3f}", str(stats.count)]


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    tokens = [rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)]
    print(
        f"hashing a {PROMPT_TOKENS}-token prompt ({PROMPT_TOKENS // CHUNK} chunks of {CHUNK}) ...", flush=True
    )
    hashing = hashing_rows(tokens, args.repeats, args.max_seconds)
    print("timing decisions ...", flush=True)
    selection = [
        row for size in FLEET_SIZES for row in selection_rows(size, args.repeats, args.max_seconds, rng)
    ]
    print()
    print(f"Hashing, {PROMPT_TOKENS} tokens, token ids uniform below {VOCAB}")
    print(tabulate(hashing, headers=["algorithm", "median ms", "p99 ms", "calls"], tablefmt="github"))
    print()
    print(
        f"Selection, {PROMPT_TOKENS}-token prompt, hit map: half the fleet holds {SYSTEM_PROMPT_CHUNKS} chunks, "
        "4 instances hold 16..512"
    )
    headers = ["instances", "step", "instances with a hit", "median ms", "p99 ms", "calls"]
    print(tabulate(selection, headers=headers, tablefmt="github"))
    return 0


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "decision",
        help="cost of hashing a 128K-token prompt and of one scheduling decision over 8..1024 instances",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--repeats", type=int, default=200, help="timed calls per row (default 200)")
    parser.add_argument("--max-seconds", type=float, default=5.0, help="time cap per row (default 5)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt, loads and hit map")
    parser.set_defaults(func=run)
