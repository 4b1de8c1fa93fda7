"""`kvgate bench account-sync`: how stale one replica's view of another's dispatches is, through Redis.

Two replicas' account syncs (gateway/fleet/account_sync.py, the code `--account-sync` runs) against a
real redis-server on loopback, each with its own load account, running their rounds every
`--interval-s` with unrelated phases, as on two machines. Each trial dispatches a request on
replica A and times how long until replica B's next decision counts it (and, after A releases it,
until B stops counting it), polling B every millisecond. Then A dies (its rounds stop, its key is
not withdrawn) and the time until B forgets its rows is measured against the TTL.

The documented bound (docs/SCALEOUT.md): about 2 x interval plus two Redis round trips; a dead
replica's rows go within TTL + interval.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import tempfile
import time
from pathlib import Path

from prometheus_client import CollectorRegistry
from tabulate import tabulate
from tqdm import tqdm

from kvgate.bench.loadgen import LatencyStats
from kvgate.gateway.background import every
from kvgate.gateway.fleet.account_sync import AccountSync
from kvgate.kvs_client.launch import start_redis_server
from kvgate.metrics.definitions import account_sync_metrics
from kvgate.scheduler.account import LoadAccount

_POLL_S = 0.001


class _Replica:
    def __init__(self, name: str, redis_url: str, interval_s: float, ttl_s: float) -> None:
        self.account = LoadAccount(600)
        self.sync = AccountSync(redis_url, self.account.rows,  # type: ignore[arg-type]
                                account_sync_metrics(CollectorRegistry()), interval_s, ttl_s, replica_id=name)
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

    async def start(self, phase_s: float) -> None:
        await asyncio.sleep(phase_s)
        self._task = asyncio.create_task(every(self._interval_s, self.sync.sync_once, "account sync"))

    async def die(self) -> None:
        """Stop without withdrawing the key, as a killed process would."""
        assert self._task is not None
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task


async def _until(predicate, timeout_s: float) -> float:
    started = time.perf_counter()
    while not predicate():
        if time.perf_counter() - started > timeout_s:
            raise TimeoutError("the other replica never saw the change")
        await asyncio.sleep(_POLL_S)
    return time.perf_counter() - started


async def measure(redis_url: str, interval_s: float, ttl_s: float, trials: int, seed: int) -> dict[str, list[float]]:
    rng = random.Random(seed)
    a = _Replica("bench-a", redis_url, interval_s, ttl_s)
    b = _Replica("bench-b", redis_url, interval_s, ttl_s)
    await asyncio.gather(a.start(0.0), b.start(rng.uniform(0, interval_s)))
    lags: dict[str, list[float]] = {"dispatch seen": [], "release seen": []}
    budget = 10 * interval_s + 1.0
    try:
        for trial in tqdm(range(trials), desc="trials", unit="trial", leave=False):
            await asyncio.sleep(rng.uniform(0, interval_s))  # dispatches land anywhere in a round
            a.account.dispatch(f"r{trial}", "instance-0", 1000, time.monotonic())
            lags["dispatch seen"].append(await _until(lambda: b.account.inflight("instance-0")[0] == 1, budget))
            await asyncio.sleep(rng.uniform(0, interval_s))
            a.account.release(f"r{trial}")
            lags["release seen"].append(await _until(lambda: b.account.inflight("instance-0")[0] == 0, budget))
        a.account.dispatch("last", "instance-0", 1000, time.monotonic())
        await _until(lambda: b.account.inflight("instance-0")[0] == 1, budget)
        await a.die()
        lags["dead replica forgotten"] = [await _until(lambda: b.account.inflight("instance-0")[0] == 0,
                                                       ttl_s + budget)]
    finally:
        await b.die()
        await a.sync.close()
        await b.sync.close()
    return lags


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("account-sync", help="staleness of --account-sync between two replicas",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval-s", type=float, default=0.1, help="--account-sync-interval-s (default 0.1)")
    parser.add_argument("--ttl-s", type=float, default=1.0, help="--account-sync-ttl-s (default 1.0)")
    parser.add_argument("--trials", type=int, default=50, help="dispatch/release pairs (default 50)")
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.interval_s <= 0 or args.ttl_s <= 2 * args.interval_s or args.trials < 1:
        print("kvgate bench account-sync: --interval-s > 0, --ttl-s > 2 x interval, --trials >= 1", flush=True)
        return 2
    with tempfile.TemporaryDirectory() as log_dir, start_redis_server(Path(log_dir)) as redis:
        lags = asyncio.run(measure(redis.url, args.interval_s, args.ttl_s, args.trials, args.seed))
    rows = []
    for what, samples in lags.items():
        stats = LatencyStats.of(samples)
        assert stats is not None
        bound = args.ttl_s + args.interval_s if what.startswith("dead") else 2 * args.interval_s
        rows.append([what, len(samples), f"{stats.p50 * 1000:.0f}", f"{stats.p99 * 1000:.0f}",
                     f"{stats.max * 1000:.0f}", f"{bound * 1000:.0f}"])
    print(f"two replicas through a real redis-server on loopback, interval {args.interval_s:g} s, TTL {args.ttl_s:g} s")
    print(tabulate(rows, headers=["change on replica A", "trials", "p50 ms", "p99 ms", "max ms", "bound ms"],
                   tablefmt="github"))
    return 0
