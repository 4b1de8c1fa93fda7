"""One scenario, three real backends: two hosts hold different blocks; the client says who holds what.

Mooncake: the real master with two store clients on 127.0.0.2 and 127.0.0.3, each putting keys
with its own preferred segment. Redis: a real redis-server written by two RedisBlockPublishers.
Embedded: the in-process index written by the same two "hosts".
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import pytest

from kvgate.config.settings import KVSBackendName, Settings
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient, make_kvs_client
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.kvs_client.redis_index import RedisBlockPublisher
from tests.services import store_clients

pytestmark = pytest.mark.timeout(120)

# Generous: these tests check answers, not speed (the benchmark measures speed).
# Long key lists are asked whole here, past the gateway's per-lookup bounds (tested in test_kvs_resilience).
SETTINGS = Settings(kvs_query_budget_ms=2000, kvs_retry_times=1, kvs_retry_interval_ms=10,
                    kvs_max_query_blocks=8192, kvs_max_answer_bytes=16 * 1024 * 1024)


class Holder(Protocol):
    endpoint: str

    async def publish(self, keys: Sequence[str]) -> None: ...

    async def withdraw(self, keys: Sequence[str]) -> None: ...


@dataclass
class Fleet:
    client: ResilientKVSClient
    first: Holder
    second: Holder


@dataclass
class EmbeddedHolder:
    index: EmbeddedKVSIndex
    endpoint: str

    async def publish(self, keys: Sequence[str]) -> None:
        self.index.add(keys, self.endpoint)

    async def withdraw(self, keys: Sequence[str]) -> None:
        self.index.remove(keys, self.endpoint)


@dataclass
class StoreClientHolder:
    """A Mooncake store client in a child process; failures to store are test failures."""

    process: object

    @property
    def endpoint(self) -> str:
        return self.process.endpoint

    async def publish(self, keys: Sequence[str]) -> None:
        assert await self.process.apublish(keys) == []

    async def withdraw(self, keys: Sequence[str]) -> None:
        assert await self.process.awithdraw(keys) == []


@pytest.fixture(scope="module")
def two_holders(mooncake_master, tmp_path_factory) -> Iterator[tuple[StoreClientHolder, StoreClientHolder]]:
    with store_clients(mooncake_master, ["127.0.0.2", "127.0.0.3"], tmp_path_factory.mktemp("store-clients")) as (
        first,
        second,
    ):
        yield StoreClientHolder(first), StoreClientHolder(second)


@pytest.fixture(params=["embedded", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("mooncake", marks=pytest.mark.mooncake)])
async def fleet(request) -> AsyncIterator[Fleet]:
    kind = request.param
    if kind == "embedded":
        index = EmbeddedKVSIndex()
        client = make_kvs_client(SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.EMBEDDED}),
                                 embedded_index=index)
        yield Fleet(client, EmbeddedHolder(index, "127.0.0.2:17901"), EmbeddedHolder(index, "127.0.0.3:17901"))
    elif kind == "redis":
        url = request.getfixturevalue("redis_url")
        settings = SETTINGS.model_copy(update={"kvs_backend": KVSBackendName.REDIS, "kvs_redis_url": url})
        client = make_kvs_client(settings)
        first, second = (
            RedisBlockPublisher(url, settings.kvs_redis_key_prefix, endpoint, ttl_s=60)
            for endpoint in ("127.0.0.2:17901", "127.0.0.3:17901")
        )
        yield Fleet(client, first, second)
        await first.close()
        await second.close()
    else:
        master = request.getfixturevalue("mooncake_master")
        first, second = request.getfixturevalue("two_holders")
        host, port = master.admin_url.removeprefix("http://").split(":")
        settings = SETTINGS.model_copy(update={
            "kvs_backend": KVSBackendName.MOONCAKE,
            "kvs_metadata_service_http_server_host": host,
            "kvs_metadata_service_http_server_port": int(port),
            # Small, so a few hundred keys already need several requests.
            "kvs_batch_query_max_url_bytes": 8192,
        })
        client = make_kvs_client(settings)
        yield Fleet(client, first, second)
    await client.close()


def _keys(label: str, count: int) -> list[str]:
    # Unique per test: the session master and redis are shared with other tests.
    run = uuid.uuid4().hex[:8]
    return [f"{run}{label}{i:05d}_0" for i in range(count)]


async def test_each_key_is_reported_at_the_endpoint_that_holds_it(fleet: Fleet):
    held_by_first, held_by_second, missing = _keys("a", 5), _keys("b", 4), _keys("m", 3)
    await fleet.first.publish(held_by_first)
    await fleet.second.publish(held_by_second)

    asked = [held_by_first[0], missing[0], held_by_second[0], *held_by_first[1:], *missing[1:], *held_by_second[1:]]
    lookup = await fleet.client.lookup(asked)

    assert lookup.status == "ok"
    expected = {**{k: (fleet.first.endpoint,) for k in held_by_first},
                **{k: (fleet.second.endpoint,) for k in held_by_second}}
    assert lookup.locations == [expected.get(key, ()) for key in asked]
    assert lookup.hit_count == len(held_by_first) + len(held_by_second)
    assert lookup.disk_locations == [()] * len(asked)


async def test_withdrawn_keys_are_missing(fleet: Fleet):
    keys = _keys("w", 4)
    await fleet.first.publish(keys)
    await fleet.first.withdraw(keys[:2])
    lookup = await fleet.client.lookup(keys)
    assert lookup.status == "ok"
    assert lookup.locations == [(), (), (fleet.first.endpoint,), (fleet.first.endpoint,)]


async def test_a_long_key_list_is_answered_completely(fleet: Fleet):
    held_by_first, held_by_second, missing = _keys("la", 1500), _keys("lb", 1500), _keys("lm", 96)
    await fleet.first.publish(held_by_first)
    await fleet.second.publish(held_by_second)
    asked = [key for triple in zip(held_by_first, held_by_second, missing * 16, strict=False) for key in triple]
    asked += held_by_first[len(asked) // 3:] + held_by_second[len(asked) // 3:]

    backend = fleet.client.backend
    if isinstance(backend, MooncakeMasterBackend):
        batches = backend.plan_requests(asked)
        assert len(batches) >= 5, "the list must really be split across requests"
        assert [key for batch in batches for key in batch.keys] == asked
        assert max(len(batch.url) for batch in batches) <= backend.max_url_bytes

    lookup = await fleet.client.lookup(asked)
    assert lookup.status == "ok"
    owner = {**dict.fromkeys(held_by_first, fleet.first.endpoint), **dict.fromkeys(held_by_second, fleet.second.endpoint)}
    assert lookup.locations == [(owner[key],) if key in owner else () for key in asked]
    assert lookup.hit_count == 3000
