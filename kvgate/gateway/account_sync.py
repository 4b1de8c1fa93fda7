"""`--account-sync redis://...`: gateway replicas share their dispatch accounts through Redis.

Every `account_sync_interval_s` a replica publishes its rows (per instance: requests in flight,
requests awaiting their first token, their uncomputed prompt tokens) as one key that expires after
`account_sync_ttl_s`, then reads every other replica's key and folds their sums into its account
(`set_remote`), so its next decisions count what the others sent.

Staleness: a dispatch on replica A reaches B's decisions at most one interval later on A's side
(its next publication) plus one interval on B's side (its next read), plus two Redis round trips:
~2 x interval (200 ms by default). A replica that dies stops refreshing its key: its rows vanish
within the TTL plus one interval. When Redis fails, the replica keeps routing on its own rows
(the others' are dropped rather than trusted stale), logs the transition once and reports
`kvgate_account_sync_up 0`; no request ever waits on Redis.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Mapping
from typing import Protocol

import orjson
import redis.asyncio as redis
from redis.exceptions import RedisError

from kvgate.metrics.definitions import AccountSyncMetrics
from kvgate.scheduler.account import Counts

log = logging.getLogger(__name__)

KEY_PREFIX = "kvgate:account:"


class SyncedRows(Protocol):
    def local_totals(self) -> dict[str, Counts]: ...

    def set_remote(self, totals: Mapping[str, Counts]) -> None: ...


class AccountSync:
    def __init__(
        self,
        url: str,
        rows: SyncedRows,
        metrics: AccountSyncMetrics,
        interval_s: float,
        ttl_s: float,
        replica_id: str | None = None,
    ) -> None:
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._key = KEY_PREFIX + self.replica_id
        self._rows = rows
        self._metrics = metrics
        self._ttl_ms = int(ttl_s * 1000)
        # No call may outlast the interval: a slow Redis delays the next round, never a request.
        self._client = redis.Redis.from_url(url, socket_timeout=interval_s, socket_connect_timeout=interval_s,
                                            retry_on_timeout=False)
        self._up: bool | None = None

    async def sync_once(self) -> None:
        """Publish this replica's rows, fold in the others'. Never raises for a store failure."""
        try:
            remote, replicas = await self._exchange()
        except (RedisError, OSError) as exc:
            self._rows.set_remote({})
            self._metrics.failures.inc()
            self._set_up(False, exc)
            return
        self._rows.set_remote(remote)
        self._metrics.replicas.set(replicas)
        self._set_up(True)

    async def _exchange(self) -> tuple[dict[str, Counts], int]:
        payload = orjson.dumps({k: list(v) for k, v in self._rows.local_totals().items()})
        await self._client.set(self._key, payload, px=self._ttl_ms)
        keys = [key async for key in self._client.scan_iter(match=KEY_PREFIX + "*", count=1000)
                if key.decode() != self._key]
        remote: dict[str, Counts] = {}
        published = await self._client.mget(keys) if keys else []
        replicas = 0
        for raw in published:
            if raw is None:  # expired between SCAN and MGET
                continue
            replicas += 1
            for instance_id, (requests, awaiting, tokens) in orjson.loads(raw).items():
                r, a, t = remote.get(instance_id, (0, 0, 0))
                remote[instance_id] = (r + requests, a + awaiting, t + tokens)
        return remote, replicas

    def _set_up(self, up: bool, error: Exception | None = None) -> None:
        self._metrics.up.set(1 if up else 0)
        if up != self._up:
            if up:
                log.info("account sync: connected; replica %s shares its rows", self.replica_id)
            else:
                log.warning("account sync: the store failed (%s); routing on this replica's own rows only", error)
        self._up = up

    async def close(self) -> None:
        """Withdraw this replica's rows at once (the TTL would remove them anyway)."""
        with contextlib.suppress(RedisError, OSError):
            await self._client.delete(self._key)
        await self._client.aclose()
