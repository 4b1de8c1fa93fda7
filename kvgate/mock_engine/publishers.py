"""The KV stores a mock engine can publish its blocks to, behind one small async interface.

Each adapter turns a store client of kvgate.kvs_client into a `BlockPublisher`: keys that could
not be written raise, so the publication queue logs the failed batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.config.settings import Settings
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.kvs_client.redis_index import RedisBlockPublisher
from kvgate.mock_engine.publication import BlockPublisher

if TYPE_CHECKING:
    from kvgate.kvs_client.mooncake_store_publisher import MooncakeStorePublisher

logger = logging.getLogger(__name__)

PUBLISH_BACKENDS = ("none", "embedded", "redis", "mooncake")


class PublishError(RuntimeError):
    """The store refused some keys."""


@dataclass(frozen=True)
class PublisherOptions:
    backend: str
    settings: Settings
    # This engine's address in the store, which the gateway maps to the instance
    # (InstanceConfig.kvs_endpoints): the IP its Mooncake client binds, or the endpoint
    # string it claims blocks under in Redis and the embedded index.
    local_ip: str = "127.0.0.2"
    mooncake_master: str = "127.0.0.1:50051"
    mooncake_metadata_url: str = "http://127.0.0.1:8080/metadata"


class MooncakeBlockPublisher:
    """Blocks become objects in the real Mooncake store, on this engine's own segment."""

    def __init__(self, store: MooncakeStorePublisher) -> None:
        self._store = store

    @property
    def endpoint(self) -> str:
        return self._store.endpoint

    async def publish(self, keys: Sequence[str]) -> None:
        _check("stored", await self._store.apublish(keys), self.endpoint)

    async def withdraw(self, keys: Sequence[str]) -> None:
        _check("removed", await self._store.awithdraw(keys), self.endpoint)

    async def close(self) -> None:
        # Closing the client makes the master forget every object on its segment.
        await self._store.aclose()


class EmbeddedBlockPublisher:
    """Blocks go straight into an in-process index shared with the gateway (kvgate demo, tests)."""

    def __init__(self, index: EmbeddedKVSIndex, endpoint: str) -> None:
        self._index = index
        self.endpoint = endpoint

    async def publish(self, keys: Sequence[str]) -> None:
        self._index.add(keys, self.endpoint)

    async def withdraw(self, keys: Sequence[str]) -> None:
        self._index.remove(keys, self.endpoint)

    async def close(self) -> None:
        self._index.remove_endpoint(self.endpoint)


class RefreshingRedisPublisher:
    """Claims in the Redis index expire unless refreshed: refresh them all every third of the ttl."""

    def __init__(self, publisher: RedisBlockPublisher, ttl_s: float) -> None:
        self._publisher = publisher
        self._interval_s = ttl_s / 3
        self._refresher = asyncio.get_running_loop().create_task(self._refresh_forever())

    @property
    def endpoint(self) -> str:
        return self._publisher.endpoint

    async def publish(self, keys: Sequence[str]) -> None:
        await self._publisher.publish(keys)

    async def withdraw(self, keys: Sequence[str]) -> None:
        await self._publisher.withdraw(keys)

    async def close(self) -> None:
        self._refresher.cancel()
        await asyncio.gather(self._refresher, return_exceptions=True)
        try:
            await self._publisher.withdraw_all()
        finally:
            await self._publisher.close()

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._publisher.refresh_all()
            except Exception as exc:  # Redis away: claims lapse, the next refresh restores them
                logger.warning("%s: refreshing Redis claims failed: %s", self.endpoint, exc)


def _check(what: str, failed: Sequence[str], endpoint: str) -> None:
    if failed:
        raise PublishError(f"{endpoint}: {len(failed)} key(s) not {what}, e.g. {failed[0]!r}")


async def open_publisher(
    options: PublisherOptions, embedded_index: EmbeddedKVSIndex | None = None
) -> BlockPublisher | None:
    """Connect to the chosen store; None for "none". Raises with the store's own error if it cannot."""
    if options.backend == "none":
        return None
    if options.backend == "embedded":
        if embedded_index is None:
            raise ValueError("the embedded index lives in one process: pass the gateway's index")
        return EmbeddedBlockPublisher(embedded_index, options.local_ip)
    if options.backend == "redis":
        s = options.settings
        publisher = RedisBlockPublisher(
            s.kvs_redis_url, s.kvs_redis_key_prefix, options.local_ip, ttl_s=s.kvs_redis_block_ttl_s
        )
        return RefreshingRedisPublisher(publisher, s.kvs_redis_block_ttl_s)
    if options.backend == "mooncake":
        from kvgate.kvs_client.mooncake_store_publisher import MooncakeStorePublisher

        store = MooncakeStorePublisher(
            options.local_ip, options.mooncake_master, options.mooncake_metadata_url
        )
        try:
            await store.aopen()
        except BaseException:
            await store.aclose()  # stops its worker thread
            raise
        return MooncakeBlockPublisher(store)
    raise ValueError(f"unknown publish backend {options.backend!r}; choose from {PUBLISH_BACKENDS}")
