"""The Redis block index on a real redis-server: claim expiry, clean shutdown, the server dying."""

from __future__ import annotations

import asyncio

import pytest
import redis

from kvgate.config.settings import Settings
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.redis_index import RedisBlockPublisher, RedisIndexBackend
from tests.services import running_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

PREFIX = "kvgate:test:"
A, B = "127.0.0.2:17901", "127.0.0.3:17901"
ANSWER_CHECKS = Settings(kvs_query_budget_ms=1000)


def _client(url: str, settings: Settings = ANSWER_CHECKS) -> ResilientKVSClient:
    backend = RedisIndexBackend(url, PREFIX, request_timeout_s=settings.kvs_query_budget_ms / 1000)
    return ResilientKVSClient(backend, settings)


async def test_a_stale_claim_disappears_while_a_refreshed_one_stays(redis_url):
    crashed = RedisBlockPublisher(redis_url, PREFIX, A, ttl_s=0.3)
    alive = RedisBlockPublisher(redis_url, PREFIX, B, ttl_s=0.3)
    client = _client(redis_url)
    await crashed.publish(["shared", "only-a"])
    await alive.publish(["shared"])
    assert (await client.lookup(["shared", "only-a"])).locations == [(A, B), (A,)]

    # B keeps refreshing; A stopped (crashed) and its claims go stale.
    for _ in range(4):
        await asyncio.sleep(0.1)
        await alive.refresh_all()
    lookup = await client.lookup(["shared", "only-a"])
    assert (lookup.status, lookup.locations) == ("ok", [(B,), ()])

    # Keys nobody refreshes leave Redis entirely.
    raw = redis.Redis.from_url(redis_url, socket_timeout=5)
    assert raw.exists(PREFIX + "only-a") == 0
    assert 0 < raw.pttl(PREFIX + "shared") <= 300
    raw.close()
    for closable in (crashed, alive, client):
        await closable.close()


async def test_withdraw_and_clean_close_remove_only_the_publishers_own_claims(redis_url):
    first = RedisBlockPublisher(redis_url, PREFIX, A, ttl_s=60)
    second = RedisBlockPublisher(redis_url, PREFIX, B, ttl_s=60)
    client = _client(redis_url)
    await first.publish(["k1", "k2", "k3"])
    await second.publish(["k1"])
    await first.withdraw(["k2"])
    assert (await client.lookup(["k1", "k2", "k3"])).locations == [(A, B), (), (A,)]
    await first.close()
    assert (await client.lookup(["k1", "k2", "k3"])).locations == [(B,), (), ()]
    await second.close()
    await client.close()


async def test_redis_killed_mid_run_gives_fast_misses_then_skips(tmp_path):
    budget_ms = 200
    settings = Settings(kvs_query_budget_ms=budget_ms, kvs_retry_times=2, kvs_retry_interval_ms=20,
                        kvs_metadata_service_down_duration_s=60)
    with running_redis_server(tmp_path) as server:
        publisher = RedisBlockPublisher(server.url, PREFIX, A, ttl_s=60)
        client = _client(server.url, settings)
        await publisher.publish(["k1"])
        assert (await client.lookup(["k1", "k2"])).locations == [(A,), ()]
        server.kill()
        lookup = await client.lookup(["k1", "k2"])
        assert (lookup.status, lookup.locations) == ("error", [(), ()])
        assert lookup.elapsed_s < budget_ms / 1000 + 0.2
        assert client.is_down
        assert (await client.lookup(["k1"])).status == "down"
        await publisher.close()  # Redis is gone: logs, does not raise
        await client.close()
