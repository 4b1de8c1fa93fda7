"""`--account-sync redis://`: replicas see each other's dispatches, forget a dead one, and survive Redis."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from kvgate.gateway.http.server import GatewayHandle, start_gateway
from kvgate.processes import free_port
from tests.gateway_helpers import assert_nothing_in_flight, counter_value, gateway_settings, tokenizer
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream
from tests.services import running_redis_server

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

SYNC = {"account_sync_interval_s": 0.05, "account_sync_ttl_s": 0.5, "kvs_backend": "embedded"}
HOLD = Script(chunks=400, delay_s=0.1)  # a stream that lasts until the test ends it


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    engine = await ScriptedUpstream("e0", HOLD).start()
    yield engine
    await engine.close()


async def replica(upstream: ScriptedUpstream, redis_url: str) -> GatewayHandle:
    settings = gateway_settings({"e0": upstream.url}, MODEL, account_sync=redis_url, **SYNC)
    return await start_gateway(settings, tokenizer=tokenizer())


async def seen_requests(url: str) -> int:
    """num_requests on e0 in the replica's next decision (its own dispatches and the others')."""
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    async with aiohttp.ClientSession() as session, session.post(url + "/debug/schedule", json=body) as response:
        return (await response.json())["instances"][0]["metrics"]["num_requests"]


async def until_seen(url: str, requests: int, timeout_s: float = 10) -> float:
    """Seconds until the replica at `url` sees `requests` in flight on e0."""
    started = time.monotonic()
    while await seen_requests(url) != requests:
        assert time.monotonic() - started < timeout_s, f"{url} never saw {requests} request(s) in flight"
        await asyncio.sleep(0.01)
    return time.monotonic() - started


async def hold_one(client: aiohttp.ClientSession, url: str) -> aiohttp.ClientResponse:
    held = await client.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "stream": True})
    assert held.status == 200
    await held.content.readline()
    return held


async def test_replicas_see_each_others_dispatches_and_forget_a_killed_one(tmp_path, upstream, redis_url):
    port = free_port()
    config = tmp_path / "replica.yaml"
    config.write_text(orjson.dumps({
        "port": port, "workers": 1, "account_sync": redis_url, **SYNC,
        "stats_poll_interval_s": 60, "health_check_interval_s": 60,
        "instances": [{"id": "e0", "url": upstream.url, "model": MODEL}],
    }).decode())
    other = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
    other_url = f"http://127.0.0.1:{port}"
    local = await replica(upstream, redis_url)
    try:
        line = await asyncio.wait_for(asyncio.to_thread(other.stdout.readline), timeout=90)
        assert "listening" in line, other.stderr.read()
        async with aiohttp.ClientSession() as client:
            mine = await hold_one(client, local.url)
            await until_seen(other_url, 1)  # the other replica folds in this one's dispatch
            theirs = await hold_one(client, other_url)
            await until_seen(local.url, 2)
            await until_seen(other_url, 2)
            # A replica that dies takes its rows with it, within the TTL.
            other.send_signal(signal.SIGKILL)
            other.wait(timeout=10)
            assert await until_seen(local.url, 1, timeout_s=5) < 0.5 + 0.5  # TTL + margin
            mine.close()
            theirs.close()
        await assert_nothing_in_flight(local)
        await until_seen(local.url, 0)
    finally:
        await local.close()
        if other.poll() is None:
            other.kill()
            other.wait()


async def test_redis_killed_mid_run_fails_no_request(tmp_path, caplog):
    upstream = await ScriptedUpstream("e0", Script()).start()
    with running_redis_server(tmp_path) as redis_server:
        gateway = await replica(upstream, redis_server.url)
        try:
            async with aiohttp.ClientSession() as client:
                async def ask() -> int:
                    body = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
                    async with client.post(gateway.url + "/v1/completions", json=body) as response:
                        await response.read()
                        return response.status

                statuses = [await ask() for _ in range(20)]
                assert counter_value(gateway, "kvgate_account_sync_up") == 1
                with caplog.at_level(logging.WARNING, logger="kvgate.gateway.fleet.account_sync"):
                    redis_server.kill()
                    for _ in range(60):  # requests keep flowing while the sync notices and after
                        statuses.append(await ask())
                        await asyncio.sleep(0.01)
            assert statuses == [200] * 80
            assert counter_value(gateway, "kvgate_account_sync_up") == 0
            assert counter_value(gateway, "kvgate_account_sync_failures_total") >= 1
            assert "routing on this replica's own rows only" in caplog.text
            await assert_nothing_in_flight(gateway)
        finally:
            await gateway.close()
            await upstream.close()
