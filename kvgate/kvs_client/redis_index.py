"""A block index in Redis, for fleets without a Mooncake master.

Schema (one sorted set per block key):

    key:     {kvs_redis_key_prefix}{block_key}        e.g. "kvgate:kv:9f2c..._0"
    members: endpoints holding the block              e.g. "127.0.0.2:17901"
    score:   when that endpoint's claim expires, Unix time in milliseconds

An engine (RedisBlockPublisher) adds or refreshes its claim with ZADD, score = now + ttl, and
re-publishes blocks it still holds before the ttl runs out; it withdraws evicted blocks with
ZREM. A crashed engine's claims simply stop being fresh: readers ignore members whose score
is in the past, so one engine going away never hides the block of another. Every publish also
sets the whole key's PEXPIRE to the ttl, so keys nobody refreshes disappear from Redis.
Publishers sharing a prefix should use the same ttl (a shorter one would expire the key early).

Readers (RedisIndexBackend) send one pipeline per lookup: ZRANGEBYSCORE key (now +inf for
each asked key, one round trip however many keys. Scores use the wall clock of publisher and
reader, so their clocks must agree to well within the ttl (NTP).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import redis.asyncio as redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from kvgate.kvs_client.base import Endpoints, KVSAnswer, KVSQueryError

log = logging.getLogger(__name__)


def _connect(url: str, timeout_s: float) -> redis.Redis:
    # No retries inside redis-py (its default retries ten times): ResilientKVSClient decides.
    return redis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),
        decode_responses=True,
    )


def _now_ms() -> int:
    return int(time.time() * 1000)


class RedisIndexBackend:
    name = "redis"

    def __init__(self, url: str, key_prefix: str, *, request_timeout_s: float) -> None:
        self.url = url
        self.key_prefix = key_prefix
        self._client = _connect(url, request_timeout_s)

    async def query(self, keys: Sequence[str]) -> KVSAnswer:
        unique = list(dict.fromkeys(keys))
        if not unique:
            return KVSAnswer({}, {})
        now = _now_ms()
        try:
            async with self._client.pipeline(transaction=False) as pipe:
                for key in unique:
                    pipe.zrangebyscore(self.key_prefix + key, f"({now}", "+inf")
                replies = await pipe.execute()
        except (RedisError, OSError, TimeoutError) as exc:
            raise KVSQueryError(f"Redis {self.url}: {type(exc).__name__}: {exc}") from exc
        locations: dict[str, Endpoints] = {
            key: tuple(sorted(members)) for key, members in zip(unique, replies, strict=True) if members
        }
        return KVSAnswer(locations, {})

    async def close(self) -> None:
        await self._client.aclose()


class RedisBlockPublisher:
    """An engine's side of the index: claim, refresh and withdraw blocks held at `endpoint`."""

    def __init__(self, url: str, key_prefix: str, endpoint: str, *, ttl_s: float, timeout_s: float = 2.0) -> None:
        self.key_prefix = key_prefix
        self.endpoint = endpoint
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self._client = _connect(url, timeout_s)
        # What this publisher claims, so it can withdraw everything on a clean shutdown.
        self._published: set[str] = set()

    async def publish(self, keys: Sequence[str]) -> None:
        """Claim (or refresh the claim on) keys for ttl; raises redis errors to the engine."""
        if not keys:
            return
        expires_at = _now_ms() + self.ttl_ms
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zadd(self.key_prefix + key, {self.endpoint: expires_at})
                pipe.pexpire(self.key_prefix + key, self.ttl_ms)
            await pipe.execute()
        self._published.update(keys)

    async def withdraw(self, keys: Sequence[str]) -> None:
        if not keys:
            return
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.zrem(self.key_prefix + key, self.endpoint)
            await pipe.execute()
        self._published.difference_update(keys)

    async def refresh_all(self) -> None:
        """Re-publish every held block; call more often than the ttl."""
        await self.publish(list(self._published))

    async def withdraw_all(self) -> None:
        await self.withdraw(list(self._published))

    async def close(self, withdraw: bool = True) -> None:
        """Withdraw every claim (an engine that stops holds nothing), then disconnect.

        If Redis is unreachable the claims are left to expire after the ttl.
        """
        try:
            if withdraw:
                await self.withdraw_all()
        except (RedisError, OSError, TimeoutError) as exc:
            log.warning("Redis index: could not withdraw %d claims of %s (they expire in %.0fs): %s",
                        len(self._published), self.endpoint, self.ttl_ms / 1000, exc)
        finally:
            await self._client.aclose()
