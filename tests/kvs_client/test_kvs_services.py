"""The shared service fixtures themselves: real master, real store clients, real redis-server."""

from __future__ import annotations

import json
import urllib.request

import pytest
import redis

from tests.services import store_clients

pytestmark = pytest.mark.timeout(120)


def _batch_query(admin_url: str, keys: list[str]) -> dict:
    with urllib.request.urlopen(f"{admin_url}/batch_query_keys?keys={','.join(keys)}", timeout=5) as response:
        return json.loads(response.read())["data"]


@pytest.mark.mooncake
def test_store_clients_on_two_loopback_ips_are_reported_at_their_own_endpoints(mooncake_master, tmp_path):
    assert mooncake_master.healthy()
    with store_clients(mooncake_master, ["127.0.0.2", "127.0.0.3"], tmp_path) as (first, second):
        assert first.endpoint.startswith("127.0.0.2:") and second.endpoint.startswith("127.0.0.3:")
        assert first.publish(["svc-a1", "svc-a2"]) == []
        assert second.publish(["svc-b1"]) == []
        data = _batch_query(mooncake_master.admin_url, ["svc-a1", "svc-a2", "svc-b1", "svc-none"])
        endpoints = {key: [v["transport_endpoint_"] for v in (entry["values"] or [])] for key, entry in data.items()}
        assert endpoints == {
            "svc-a1": [first.endpoint], "svc-a2": [first.endpoint], "svc-b1": [second.endpoint], "svc-none": [],
        }
        assert first.withdraw(["svc-a1", "never-published"]) == []
        assert _batch_query(mooncake_master.admin_url, ["svc-a1"])["svc-a1"]["ok"] is False
    # Closed clients take their objects with them.
    data = _batch_query(mooncake_master.admin_url, ["svc-a2", "svc-b1"])
    assert all(entry["ok"] is False for entry in data.values())


@pytest.mark.redis
def test_redis_server_answers_and_is_flushed_between_tests(redis_url):
    client = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        assert client.ping()
        assert client.dbsize() == 0
        client.set("svc-probe", "1")
        assert client.config_get("save") == {"save": ""}
    finally:
        client.close()
