"""Real services for tests: Mooncake master, Mooncake store clients on loopback IPs, redis-server.

The launchers live in kvgate.kvs_client.launch (the benchmarks use them too); this module adds
what only tests need: skipping when a binary is absent, and store clients as child processes.

    def test_x(mooncake_master, tmp_path):
        with store_client(mooncake_master, "127.0.0.2", tmp_path) as client:
            client.publish(["k1"])          # the master now reports k1 at client.endpoint
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvgate.kvs_client.launch import (
    MooncakeMasterProcess,
    RedisServerProcess,
    mooncake_master_binary,
    redis_server_binary,
    start_mooncake_master,
    start_redis_server,
)
from kvgate.kvs_client.publisher_process import PublisherProcess


def require_mooncake() -> None:
    """Skip (with the reason) when the Mooncake binary or Python client is not installed."""
    if mooncake_master_binary() is None:
        pytest.skip("mooncake_master not on PATH (pip install mooncake-transfer-engine-non-cuda)")
    if importlib.util.find_spec("mooncake") is None:
        pytest.skip("mooncake.store not importable (pip install mooncake-transfer-engine-non-cuda)")


def require_redis() -> None:
    if redis_server_binary() is None:
        pytest.skip("redis-server not on PATH (apt-get install redis-server)")


@contextlib.contextmanager
def running_mooncake_master(log_dir: Path) -> Iterator[MooncakeMasterProcess]:
    """A master of one's own, e.g. for a test that kills it; the session one is `mooncake_master`."""
    require_mooncake()
    with start_mooncake_master(log_dir) as master:
        yield master


@contextlib.contextmanager
def running_redis_server(log_dir: Path) -> Iterator[RedisServerProcess]:
    require_redis()
    with start_redis_server(log_dir) as server:
        yield server


@contextlib.contextmanager
def store_client(master: MooncakeMasterProcess, local_ip: str, log_dir: Path) -> Iterator[PublisherProcess]:
    """A Mooncake store client bound to `local_ip` in a child process; its keys go when it closes."""
    with store_clients(master, [local_ip], log_dir) as (client,):
        yield client


@contextlib.contextmanager
def store_clients(
    master: MooncakeMasterProcess, local_ips: Sequence[str], log_dir: Path
) -> Iterator[list[PublisherProcess]]:
    """One store client per IP, closed in parallel (a clean close takes ~2 s each).

    Started from this thread, so the children die with the test run if it is killed.
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    clients: list[PublisherProcess] = []
    try:
        for ip in local_ips:
            clients.append(
                PublisherProcess(ip, master.rpc_address, master.metadata_url, log_dir / f"store-client-{ip}.log")
            )
        yield clients
    finally:
        with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
            list(pool.map(PublisherProcess.close, clients))
