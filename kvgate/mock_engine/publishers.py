"""The KV stores a mock engine can publish its blocks to, behind one small async interface.

Each adapter turns a store client of kvgate.kvs_client into a `BlockPublisher`: keys that could
not be written raise, so the publication queue logs the failed batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.config.settings import Settings
from kvgate.mock_engine.publication import BlockPublisher

if TYPE_CHECKING:
    from kvgate.kvs_client.mooncake_store_publisher import MooncakeStorePublisher

PUBLISH_BACKENDS = ("none", "embedded", "redis", "mooncake")


class PublishError(RuntimeError):
    """The store refused some keys."""


@dataclass(frozen=True)
class PublisherOptions:
    backend: str
    settings: Settings
    # This engine's address in the store: the loopback IP its Mooncake client binds, which the
    # gateway maps to the instance (InstanceConfig.kvs_endpoints).
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


def _check(what: str, failed: Sequence[str], endpoint: str) -> None:
    if failed:
        raise PublishError(f"{endpoint}: {len(failed)} key(s) not {what}, e.g. {failed[0]!r}")


async def open_publisher(options: PublisherOptions) -> BlockPublisher | None:
    """Connect to the chosen store; None for "none". Raises with the store's own error if it cannot."""
    if options.backend == "none":
        return None
    if options.backend == "mooncake":
        from kvgate.kvs_client.mooncake_store_publisher import MooncakeStorePublisher

        store = MooncakeStorePublisher(options.local_ip, options.mooncake_master, options.mooncake_metadata_url)
        try:
            await store.aopen()
        except BaseException:
            await store.aclose()  # stops its worker thread
            raise
        return MooncakeBlockPublisher(store)
    raise ValueError(f"unknown publish backend {options.backend!r}; choose from {PUBLISH_BACKENDS}")
