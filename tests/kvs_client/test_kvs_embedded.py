"""The in-process index and the factory."""

from __future__ import annotations

from kvgate.config.settings import KVSBackendName, Settings
from kvgate.kvs_client import EmbeddedKVSIndex, make_kvs_client
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.kvs_client.redis_index import RedisIndexBackend


async def test_index_tracks_adds_removes_and_stopped_endpoints():
    index = EmbeddedKVSIndex()
    index.add(["k1", "k2"], "127.0.0.3:1")
    index.add(["k1"], "127.0.0.2:1")
    assert index.holders("k1") == ("127.0.0.2:1", "127.0.0.3:1"), "sorted: answers are deterministic"
    index.remove(["k1", "never-added"], "127.0.0.3:1")
    answer = await index.query(["k1", "k2", "k3"])
    assert dict(answer.locations) == {"k1": ("127.0.0.2:1",), "k2": ("127.0.0.3:1",)}
    index.remove_endpoint("127.0.0.3:1")
    assert len(index) == 1 and index.holders("k2") == ()


async def test_factory_builds_the_configured_backend_and_shares_a_given_index():
    index = EmbeddedKVSIndex()
    client = make_kvs_client(Settings(kvs_backend=KVSBackendName.EMBEDDED), embedded_index=index)
    index.add(["k"], "127.0.0.2:1")
    assert (await client.lookup(["k"])).locations == [("127.0.0.2:1",)]

    mooncake = make_kvs_client(Settings(kvs_metadata_service_http_server_port=9100, kvs_batch_query_max_url_bytes=4096))
    assert isinstance(mooncake.backend, MooncakeMasterBackend)
    assert (mooncake.backend.base_url, mooncake.backend.max_url_bytes) == ("http://127.0.0.1:9100", 4096)
    redis_client = make_kvs_client(Settings(kvs_backend=KVSBackendName.REDIS))
    assert isinstance(redis_client.backend, RedisIndexBackend)
    for each in (client, mooncake, redis_client):
        await each.close()
