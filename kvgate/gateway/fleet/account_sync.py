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

The others' values are untrusted (peer_rows.py): each is fetched only up to
`account_sync_max_row_bytes`, at most `account_sync_max_peers` of them per round, and checked
whole. A value that fails is dropped alone (`kvgate_account_sync_rejected{reason}`, and one warning
line a minute at most), so the good peers' rows stay fresh. A round that fails for any other reason
drops the others' rows, counts a failure and reports `kvgate_account_sync_up 0` like a store failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import uuid
from collections import Counter
from collections.abc import Mapping
from typing import Protocol

import orjson
import redis.asyncio as redis
from redis.exceptions import RedisError

from kvgate.gateway.fleet.peer_rows import MalformedRows, parse_peer_rows
from kvgate.metrics.definitions import AccountSyncMetrics
from kvgate.scheduler.account import Counts

log = logging.getLogger(__name__)

KEY_PREFIX = "kvgate:account:"
_DROP_LOG_EVERY_S = 60.0


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
        max_peers: int = 256,
        max_row_bytes: int = 512 * 1024,
    ) -> None:
        self.replica_id = replica_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._key = (KEY_PREFIX + self.replica_id).encode()
        self._rows = rows
        self._metrics = metrics
        self._ttl_ms = int(ttl_s * 1000)
        self._max_peers = max_peers
        self._max_row_bytes = max_row_bytes
        # No call may outlast the interval: a slow Redis delays the next round, never a request.
        self._client = redis.Redis.from_url(url, socket_timeout=interval_s, socket_connect_timeout=interval_s,
                                            retry_on_timeout=False)
        self._up: bool | None = None
        self._drops = _DropLog(_DROP_LOG_EVERY_S)

    async def sync_once(self) -> None:
        """Publish this replica's rows, fold in the others'. Never raises (a bad round is counted)."""
        try:
            remote, replicas = await self._exchange()
        except Exception as exc:  # the store failed, or a bug: never a frozen view of the others
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
        keys = await self._peer_keys()
        published = await self._fetch(keys) if keys else []
        remote: dict[str, Counts] = {}
        replicas = 0
        for key, raw in zip(keys, published, strict=True):
            try:
                rows = self._checked(raw)
            except MalformedRows as exc:
                self._drop(key, exc)
                continue
            if rows is None:  # expired between SCAN and the read
                continue
            replicas += 1
            for instance_id, (requests, awaiting, tokens) in rows.items():
                r, a, t = remote.get(instance_id, (0, 0, 0))
                remote[instance_id] = (r + requests, a + awaiting, t + tokens)
        return remote, replicas

    async def _peer_keys(self) -> list[bytes]:
        """The other replicas' keys, at most `max_peers` (a flood of keys is dropped, counted once)."""
        keys: list[bytes] = []
        async for key in self._client.scan_iter(match=KEY_PREFIX + "*", count=1000):
            if key == self._key:
                continue
            if len(keys) == self._max_peers:
                self._drop(key, MalformedRows("too_many_peers", f"more than {self._max_peers} peers' keys"))
                break
            keys.append(key)
        return keys

    async def _fetch(self, keys: list[bytes]) -> list[object]:
        """Each key's value cut at one byte beyond the limit (a 20 MB value costs 512 KB), or the
        error Redis gave for that key alone (a list or hash under the prefix)."""
        async with self._client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.getrange(key, 0, self._max_row_bytes)
            return await pipe.execute(raise_on_error=False)

    def _checked(self, raw: object) -> dict[str, Counts] | None:
        if isinstance(raw, Exception):
            raise MalformedRows("wrong_type", f"not a string value ({raw})")
        assert isinstance(raw, bytes)
        if not raw:  # GETRANGE of a missing key
            return None
        if len(raw) > self._max_row_bytes:
            raise MalformedRows("too_large", f"larger than {self._max_row_bytes} bytes")
        return parse_peer_rows(raw)

    def _drop(self, key: bytes, error: MalformedRows) -> None:
        self._metrics.rejected.labels(error.reason).inc()
        self._drops.add(key, error)

    def _set_up(self, up: bool, error: Exception | None = None) -> None:
        self._metrics.up.set(1 if up else 0)
        if up != self._up:
            if up:
                log.info("account sync: connected; replica %s shares its rows", self.replica_id)
            else:
                log.warning("account sync: a round failed (%s: %s); routing on this replica's own rows only",
                            type(error).__name__, error)
        self._up = up

    async def close(self) -> None:
        """Withdraw this replica's rows at once (the TTL would remove them anyway)."""
        with contextlib.suppress(RedisError, OSError):
            await self._client.delete(self._key)
        await self._client.aclose()


class _DropLog:
    """One warning line per `every_s` at most, summing up the values dropped since the last one:
    a poisoned key is seen every round, and a log line per round would flood the logs."""

    def __init__(self, every_s: float) -> None:
        self._every_s = every_s
        self._logged_at = -every_s
        self._reasons: Counter[str] = Counter()

    def add(self, key: bytes, error: MalformedRows) -> None:
        self._reasons[error.reason] += 1
        now = time.monotonic()
        if now - self._logged_at < self._every_s:
            return
        reasons = ", ".join(f"{reason} x{count}" for reason, count in sorted(self._reasons.items()))
        log.warning("account sync: dropped other replicas' rows that do not count (%s since the last such line; "
                    "at most one a minute); e.g. key %s: %.200s", reasons, repr(key[:80]), str(error))
        self._logged_at = now
        self._reasons.clear()
