"""`kvgate serve --workers 2` with engines' KV events: one subscription per engine for the whole
machine (the engine's socket monitor counts the connections), every worker reading the same index."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest

from kvgate.processes import free_port
from kvgate.workers.worker import WORKER_HEADER
from tests.kv_events_engine import FakeEventsEngine
from tests.scripted_upstream import MODEL, ScriptedUpstream
from tests.workers.test_workers_serve import stop_workers, wait_listening

pytestmark = pytest.mark.timeout(150)

BLOCK = 16
PROMPT = list(range(3000, 3000 + 3 * BLOCK + 1))


@pytest.fixture
async def engine() -> AsyncIterator[tuple[ScriptedUpstream, FakeEventsEngine]]:
    upstream = await ScriptedUpstream("e0").start()
    events = await FakeEventsEngine(block_size=BLOCK).start()
    yield upstream, events
    await events.close()
    await upstream.close()


async def hits_by_worker(url: str) -> dict[str, int]:
    """e0's prefix hit as each worker's /debug/schedule reports it (fresh connections spread over them)."""
    seen: dict[str, int] = {}
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only workers {sorted(seen)} answered"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.post(url + "/debug/schedule", json=body) as response:
            assert response.status == 200
            plan = await response.json()
            seen[response.headers[WORKER_HEADER].split(":")[0]] = plan["instances"][0]["prefix_hit_tokens"]
    return seen


async def test_workers_share_one_subscription_and_one_index(tmp_path, engine):
    upstream, events = engine
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    config = tmp_path / "gateway.yaml"
    config.write_text(orjson.dumps({
        "port": port, "workers": 2, "kvs_backend": "kv_events", "kvs_chunk_size": BLOCK,
        "dispatch_policy": "cache_aware", "cache_aware_scheduling_min_tokens": BLOCK,
        "kv_events_topic": "kv-events", "kv_events_index_bytes": 4 * 1024 * 1024,
        "health_check_interval_s": 60, "stats_poll_interval_s": 60,
        "instances": [{"id": "e0", "url": upstream.url, "model": MODEL, "kv_events_endpoint": events.endpoint,
                       "kv_events_replay_endpoint": events.replay_endpoint}],
    }).decode())
    process = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        await wait_listening(process, url)
        await events.wait_subscribed()
        await events.publish([events.store_prompt(PROMPT)])
        deadline = time.monotonic() + 30
        while set((await hits_by_worker(url)).values()) != {3 * BLOCK}:
            assert time.monotonic() < deadline, "not every worker sees the engine's blocks"
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.0)  # time for any second subscriber to show up
        assert events.accepted == 1 and events.connections == 1
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
            text = await response.text()
        assert "kvgate_kv_events_subscriptions 1.0" in text
        assert 'kvgate_kv_events_blocks{instance="e0",medium="GPU"} 3.0' in text
    finally:
        stop_workers(process)
    assert process.returncode == 0, process.stderr.read()
    await asyncio.sleep(0.2)
    assert events.connections == 0  # the subscriber closed its socket on the way out
