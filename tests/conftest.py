"""Shared fixtures: real services started once per session (see tests/services.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from kvgate.kvs_client.launch import MooncakeMasterProcess, RedisServerProcess
from tests.openai_helpers import opened_openai_clients
from tests.services import running_mooncake_master, running_redis_server


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory) -> Iterator[MooncakeMasterProcess]:
    """The real mooncake_master on free loopback ports: .admin_url, .rpc_address, .metadata_url."""
    with running_mooncake_master(tmp_path_factory.mktemp("mooncake")) as master:
        yield master


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory) -> Iterator[RedisServerProcess]:
    """A real redis-server on a free loopback port without persistence: .url."""
    with running_redis_server(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def redis_url(redis_server: RedisServerProcess) -> Iterator[str]:
    """The session redis-server's URL, flushed after the test so tests do not see each other's keys."""
    import redis

    yield redis_server.url
    client = redis.Redis.from_url(redis_server.url, socket_timeout=5)
    try:
        client.flushdb()
    finally:
        client.close()


@pytest.fixture
async def close_openai_clients() -> AsyncIterator[None]:
    """Closes the clients openai_helpers.openai_client opened during the test, while its loop still runs."""
    yield
    while opened_openai_clients:
        await opened_openai_clients.pop().close()
