"""Fuzz: random values under the account-sync prefix while a real `kvgate serve --workers 2` syncs.

Random Redis types, JSON shapes, number types, lengths and sizes, and random key names, a bounded
number of them over a bounded number of rounds, beside one well-behaved peer. The gateway must not
crash or restart a worker, stay live, keep its memory bounded and its log short, count the good
peer's rows (and forget them when it goes idle), and answer every real request.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import subprocess
import sys
from pathlib import Path

import aiohttp
import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from kvgate.gateway.fleet.account_sync import KEY_PREFIX, AccountSync
from kvgate.metrics.definitions import account_sync_metrics
from kvgate.processes import free_port
from kvgate.scheduler.account import LocalRows
from kvgate.workers.worker import WORKER_HEADER
from tests.scripted_upstream import MODEL, ScriptedUpstream

pytestmark = [pytest.mark.redis, pytest.mark.timeout(180)]

ROUNDS = 40
KEYS_PER_ROUND = 6
MAX_BIG_VALUES = 4  # a few values of megabytes; the rest are small
SYNC = {"account_sync_interval_s": 0.05, "account_sync_ttl_s": 0.5}


def random_scalar(rng: random.Random) -> object:
    return rng.choice([
        rng.randint(-(2**63), 2**63 - 1), rng.randint(0, 50), -rng.randint(1, 10**6), 2**64 - 1,
        rng.random() * 10**rng.randint(0, 30), "", "7", "x" * rng.randint(0, 300), True, None,
    ])


def random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(4 if depth < 3 else 1)
    if kind == 0:
        return random_scalar(rng)
    if kind == 1:
        return [random_json(rng, depth + 1) for _ in range(rng.randint(0, 6))]
    if kind == 2:
        return {rng.choice(["e0", "e1", "", "e/0", "é", "x" * 200]): random_json(rng, depth + 1)
                for _ in range(rng.randint(0, 6))}
    # Almost a row: the real shape with one thing wrong, or right.
    counts = [rng.choice([rng.randint(0, 9), random_scalar(rng)]) for _ in range(rng.choice([3, 3, 2, 4]))]
    return {rng.choice(["e0", "e1"]): counts}


def poison(store: redis.Redis, rng: random.Random, big_left: list[int]) -> None:
    key = KEY_PREFIX.encode() + rng.randbytes(rng.randint(0, 12))
    ttl_ms = rng.randint(100, 3000)
    kind = rng.randrange(7)
    if kind == 0:
        store.set(key, rng.randbytes(rng.randint(0, 4096)), px=ttl_ms)
    elif kind == 1 and big_left[0] > 0:
        big_left[0] -= 1
        size = rng.randint(1, 8) * 1024 * 1024
        store.set(key, b'{"e0": [' + b"1, " * (size // 3) + b"0]}", px=ttl_ms)
    elif kind == 2:
        store.delete(key)
        store.rpush(key, *[rng.randbytes(8) for _ in range(rng.randint(1, 5))])
        store.pexpire(key, ttl_ms)
    elif kind == 3:
        store.delete(key)
        store.hset(key, mapping={"e0": rng.randint(-5, 5), "e1": "x"})
        store.pexpire(key, ttl_ms)
    else:
        store.set(key, orjson.dumps(random_json(rng), option=orjson.OPT_NON_STR_KEYS), px=ttl_ms)


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) / 1024


async def views(url: str) -> dict[str, tuple[int, float]]:
    """Worker index -> (pid, num_requests on e0 in its next decision), both workers."""
    seen: dict[str, tuple[int, float]] = {}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    for _ in range(200):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.post(url + "/debug/schedule", json=body) as response:
            assert response.status == 200
            index, pid = response.headers[WORKER_HEADER].split(":")
            view = await response.json()
            e0 = next(i for i in view["instances"] if i["id"] == "e0")
            seen[index] = (int(pid), e0["metrics"]["num_requests"])
        if len(seen) == 2:
            return seen
    raise AssertionError("one worker never answered")


async def until_every_worker_sees(url: str, requests: int) -> dict[str, tuple[int, float]]:
    for _ in range(300):
        seen = await views(url)
        if all(n == requests for _, n in seen.values()):
            return seen
        await asyncio.sleep(0.05)
    raise AssertionError(f"the workers see {seen}, not {requests} requests from the good peer")


async def test_random_peer_values_never_hurt_the_gateway_or_the_good_peers_rows(tmp_path, redis_url):
    upstream = await ScriptedUpstream("e0").start()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "gateway.yaml"
    config.write_text(orjson.dumps({
        "port": port, "workers": 2, "kvs_backend": "embedded", "account_sync": redis_url, **SYNC,
        "stats_poll_interval_s": 60, "health_check_interval_s": 60,
        "instances": [{"id": "e0", "url": upstream.url, "model": MODEL},
                      {"id": "e1", "url": upstream.url, "model": MODEL}],
    }).decode())
    log_path = tmp_path / "gateway.log"
    with open(log_path, "w") as log_file:
        gateway = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                                   stdout=subprocess.PIPE, stderr=log_file, text=True,
                                   env={**os.environ, "HF_HUB_OFFLINE": "1"})
    good = LocalRows()
    good.write("e0", (7, 0, 0))
    good_sync = AccountSync(redis_url, good, account_sync_metrics(CollectorRegistry()), interval_s=0.05,
                            ttl_s=0.5, replica_id="good")

    async def publish_forever() -> None:
        while True:
            await good_sync.sync_once()
            await asyncio.sleep(0.05)

    publisher = asyncio.create_task(publish_forever())
    try:
        line = await asyncio.wait_for(asyncio.to_thread(gateway.stdout.readline), timeout=120)
        assert "listening" in line, log_path.read_text()
        before = await until_every_worker_sees(url, 7)
        leader_pid = before["0"][0]
        rss_before = rss_mb(leader_pid)

        store = redis.Redis.from_url(redis_url)
        rng = random.Random(20261124)
        big_left = [MAX_BIG_VALUES]
        statuses: list[int] = []
        async with aiohttp.ClientSession() as client:
            for round_ in range(ROUNDS):
                for _ in range(KEYS_PER_ROUND):
                    poison(store, rng, big_left)
                # Real requests beside the sync; liveness answered (bounded wait, not a speed check).
                async with client.post(url + "/v1/completions",
                                       json={"model": MODEL, "prompt": f"hi {round_}", "max_tokens": 2}) as answer:
                    await answer.read()
                    statuses.append(answer.status)
                async with asyncio.timeout(10), client.get(url + "/livez") as live:
                    assert live.status == 200
                await asyncio.sleep(0.05)
        assert statuses == [200] * ROUNDS
        # The poison is still there, yet both workers count the good peer's rows, then forget them.
        after = await until_every_worker_sees(url, 7)
        assert after == before  # same pids: no worker crashed or was restarted
        good.write("e0", (0, 0, 0))
        await until_every_worker_sees(url, 0)
        # Well-formed random values count while they live (nothing tells them from a peer's); once
        # every key has expired (3 s at most), nothing is in flight anywhere.
        for _ in range(200):
            async with aiohttp.ClientSession() as client, client.get(url + "/metrics") as metrics:
                text = await metrics.text()
            inflight = [line for line in text.splitlines() if line.startswith("kvgate_inflight_requests{")]
            if inflight and all(line.endswith(" 0.0") for line in inflight):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError(f"still in flight: {inflight}")
        assert 'kvgate_account_sync_up 1.0' in text
        assert "kvgate_account_sync_rejected_total{" in text
        assert rss_mb(leader_pid) - rss_before < 100, "reading the poisoned values kept memory"
        assert gateway.poll() is None
    finally:
        if gateway.poll() is None:
            gateway.terminate()
            gateway.wait(60)
        publisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await publisher
        await good_sync.close()
        await upstream.close()
    log = log_path.read_text()
    assert "Traceback" not in log
    assert len(log.splitlines()) < 20, log[-3000:]  # the drops are summed up, not logged one by one
