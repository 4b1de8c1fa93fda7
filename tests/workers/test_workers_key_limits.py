"""`kvgate serve --workers 2` with API keys: each key's rate and in-flight limits hold across the workers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from kvgate.processes import free_port
from kvgate.workers.worker import WORKER_HEADER
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream
from tests.workers.test_workers_serve import HOLD, start_workers, stop_workers, wait_listening

pytestmark = pytest.mark.timeout(150)

KEY = "k" * 8 + "-team-a-0123456789abcdef"
AUTH = {"Authorization": f"Bearer {KEY}"}
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 1}


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    engine = await ScriptedUpstream("e0", Script()).start()
    yield engine
    await engine.close()


@pytest.fixture
def keys_file(tmp_path) -> str:
    path = tmp_path / "keys"
    path.write_text(f"team-a:{KEY}\n")
    return str(path)


def worker_of(response: aiohttp.ClientResponse) -> str:
    return response.headers[WORKER_HEADER].split(":")[0]


async def post_fresh(url: str) -> tuple[str, int, dict, str]:
    """(worker, status, JSON body, Retry-After) of one completion over a new connection."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.post(url + "/v1/completions", json=BODY, headers=AUTH) as response:
        return worker_of(response), response.status, await response.json(), response.headers.get("Retry-After", "")


class Streams:
    """Streams held open through chosen workers: a connection learns its worker from /health, then
    carries the stream (a kept-alive connection stays with its worker)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self._sessions: list[aiohttp.ClientSession] = []
        self.held: dict[str, list[aiohttp.ClientResponse]] = {}

    async def session_on(self, worker: str) -> aiohttp.ClientSession:
        deadline = time.monotonic() + 60  # a restarting worker takes seconds to load its tokenizer
        while time.monotonic() < deadline:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1))
            async with session.get(self.url + "/health") as probe:
                await probe.read()
                if worker_of(probe) == worker:
                    self._sessions.append(session)
                    return session
            await session.close()
        raise AssertionError(f"no connection reached worker {worker}")

    async def hold(self, worker: str) -> aiohttp.ClientResponse:
        session = await self.session_on(worker)
        response = await session.post(self.url + "/v1/completions", headers=AUTH,
                                      json={**BODY, "stream": True, "max_tokens": 400})
        assert response.status == 200, await response.text()
        assert worker_of(response) == worker
        await response.content.readline()  # the engine is streaming
        self.held.setdefault(worker, []).append(response)
        return response

    async def try_on(self, worker: str) -> tuple[int, dict, str]:
        async with (await self.session_on(worker)).post(self.url + "/v1/completions", json=BODY,
                                                        headers=AUTH) as response:
            return response.status, await response.json(), response.headers.get("Retry-After", "")

    async def close(self) -> None:
        for responses in self.held.values():
            for response in responses:
                response.close()
        self.held.clear()
        for session in self._sessions:
            await session.close()
        self._sessions.clear()


async def admitted_again(url: str) -> None:
    """Hung-up streams leave the count once each worker notices: fresh requests until one is admitted."""
    deadline = time.monotonic() + 30
    while True:
        _, status, body, _ = await post_fresh(url)
        if status == 200:
            return
        assert status == 429 and body["error"]["code"] == "inflight_limited", body
        assert time.monotonic() < deadline, "the key stayed at its in-flight limit after its streams ended"
        await asyncio.sleep(0.2)


async def test_the_rate_limit_holds_across_workers(tmp_path, upstream, keys_file):
    # A burst of 4 and a refill of one per 100 s: no token comes back while the test runs.
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_workers(tmp_path, upstream.url, port, api_keys_file=keys_file,
                            api_key_rate_limit_rps=0.01, api_key_rate_limit_burst=4)
    try:
        await wait_listening(process, url)
        answers = [await post_fresh(url) for _ in range(20)]
        # The kernel spreads connections over the workers; bounded: a few more until both answered.
        for _ in range(40):
            if len({worker for worker, *_ in answers}) == 2:
                break
            answers.append(await post_fresh(url))
        assert {worker for worker, *_ in answers} == {"0", "1"}
        assert [status for _, status, _, _ in answers].count(200) == 4  # the burst, not one per worker
        for _, status, body, retry_after in answers:
            if status != 200:
                assert status == 429 and body["error"]["code"] == "rate_limited", body
                assert 90 <= int(retry_after) <= 100
        assert len(upstream.seen) == 4
    finally:
        stop_workers(process)


@contextlib.asynccontextmanager
async def a_stream_on_each_worker(tmp_path, upstream: ScriptedUpstream, keys_file: str) -> AsyncIterator[Streams]:
    """Two workers, a key allowed 2 requests in flight, and one stream of that key held on each worker."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_workers(tmp_path, upstream.url, port, api_keys_file=keys_file, api_key_max_inflight=2)
    streams = Streams(url)
    try:
        await wait_listening(process, url)
        upstream.script = HOLD
        await streams.hold("0")
        await streams.hold("1")
        yield streams
    finally:
        await streams.close()
        stop_workers(process)


async def test_the_inflight_limit_holds_across_workers(tmp_path, upstream, keys_file):
    async with a_stream_on_each_worker(tmp_path, upstream, keys_file) as streams:
        for worker in ("0", "1"):  # each worker holds one, below the limit alone: the sum decides
            status, body, retry_after = await streams.try_on(worker)
            assert status == 429 and body["error"]["code"] == "inflight_limited", body
            assert retry_after == "1"
        await streams.close()
        upstream.script = Script()
        await admitted_again(streams.url)


async def test_a_killed_workers_streams_leave_the_keys_count(tmp_path, upstream, keys_file):
    async with a_stream_on_each_worker(tmp_path, upstream, keys_file) as streams:
        status, body, _ = await streams.try_on("0")
        assert status == 429 and body["error"]["code"] == "inflight_limited", body
        os.kill(int(streams.held["1"][0].headers[WORKER_HEADER].split(":")[1]), signal.SIGKILL)
        # Once restarted, the key holds only worker 0's stream: one more is admitted, then no more.
        await streams.hold("1")
        for worker in ("1", "0"):
            status, body, _ = await streams.try_on(worker)
            assert status == 429 and body["error"]["code"] == "inflight_limited", body
