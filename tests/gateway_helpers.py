"""Shared pieces of the gateway tests: settings, the one tokenizer, in-flight checks."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.http.server import GatewayHandle
from kvgate.gateway.planning.tokenizer import load_tokenizer
from kvgate.gateway.state import GATEWAY
from tests.scripted_upstream import Script, ScriptedUpstream


@functools.cache
def tokenizer():
    """Loaded once per test session (about a second each time otherwise)."""
    return load_tokenizer()


def gateway_settings(upstreams: dict[str, str], model: str, **overrides) -> Settings:
    """Settings for a test gateway on a free port in front of `upstreams` (id -> URL)."""
    values = {
        "port": 0,
        # Health checks and scraping stay out of the way unless a test asks for them.
        "health_check_interval_s": 60.0,
        "stats_poll_interval_s": 60.0,
        "instances": [InstanceConfig(id=i, url=url, model=model) for i, url in upstreams.items()],
    }
    values.update(overrides)
    return Settings(**values)


def closed_port_url() -> str:
    """A loopback URL nothing listens on (connections are refused at once)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def scripted_upstreams(*names: str) -> AsyncIterator[dict[str, ScriptedUpstream]]:
    """Scripted engine doubles by name, each answering by the default Script until the block ends."""
    async with contextlib.AsyncExitStack() as stack:
        started: dict[str, ScriptedUpstream] = {}
        for name in names:
            started[name] = await ScriptedUpstream(name, Script()).start()
            stack.push_async_callback(started[name].close)
        yield started


async def read_streamed_completion(url: str, model: str) -> bytes:
    """The raw SSE body of a streamed completion of the prompt "p", asked of the gateway at `url`."""
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"model": model, "prompt": "p", "stream": True}) as response:
        return await response.read()


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def inflight_gauges(url: str) -> tuple[float, float]:
    """Sum of kvgate_inflight_requests and kvgate_inflight_prefill_tokens as /metrics shows them."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    sums = {"kvgate_inflight_requests": 0.0, "kvgate_inflight_prefill_tokens": 0.0}
    for family in text_string_to_metric_families(text):
        if family.name in sums:
            sums[family.name] = sum(sample.value for sample in family.samples)
    return sums["kvgate_inflight_requests"], sums["kvgate_inflight_prefill_tokens"]


async def assert_nothing_in_flight(handle: GatewayHandle, timeout_s: float = 5.0) -> None:
    """The account and the gauges must both return to zero (they may lag a cancelled handler briefly)."""
    account = handle.app[GATEWAY].account
    await wait_until(lambda: account.total_inflight() == 0, timeout_s)
    assert await inflight_gauges(handle.url) == (0.0, 0.0)


async def read_events(stream, count: int) -> None:
    """Read `count` chunks of an openai client stream, then stop (the test hangs up with close())."""
    received = 0
    async for _ in stream:
        received += 1
        if received == count:
            return


async def assert_hang_up_released(handle: GatewayHandle, *engines) -> None:
    """After a client hung up: every mock engine dropped the request, and the gateway's account,
    gauges and decode ledger are back to zero."""
    for engine in engines:
        await wait_until(lambda engine=engine: engine.loop.num_open_requests == 0)
    await assert_nothing_in_flight(handle)
    assert len(handle.app[GATEWAY].decode_ledger) == 0


def counter_value(handle: GatewayHandle, name: str, **labels: str) -> float:
    value = handle.app[GATEWAY].prometheus.get_sample_value(name, labels or None)
    return value or 0.0


class EmbeddedFleet:
    """Mock engines publishing into one in-process index, behind a cache-aware gateway reading it.

    `engine_settings` gives each engine its own hashing settings (a different seed makes an engine
    whose keys the gateway never finds); the gateway hashes with `settings`. `start` starts another
    front door over the same core instead of the HTTP gateway (the endpoint picker's `start_picker`).
    """

    def __init__(self, settings: Settings, engine_settings: dict[str, Settings], start: Callable | None = None) -> None:
        self.settings = settings
        self.engine_settings = engine_settings
        self.engines: dict = {}
        self.gateway: Any = None  # a GatewayHandle, or what `start` returned
        self._start = start

    async def __aenter__(self) -> EmbeddedFleet:
        from kvgate.engine_model import ServiceProfile
        from kvgate.gateway.http.server import start_gateway
        from kvgate.gateway.planning.tokenizer import TokenizerService
        from kvgate.kvs_client.embedded import EmbeddedKVSIndex
        from kvgate.mock_engine.publishers import PublisherOptions, open_publisher
        from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine

        index = EmbeddedKVSIndex()
        instances = []
        for number, (instance_id, engine_settings) in enumerate(self.engine_settings.items()):
            endpoint = f"127.0.0.{number + 2}"
            publisher = await open_publisher(PublisherOptions("embedded", engine_settings, local_ip=endpoint), index)
            profile = ServiceProfile().with_block_size(engine_settings.kvs_chunk_size)
            config = MockEngineConfig(time_scale=0.0, profile=profile, settings=engine_settings)
            engine = await start_mock_engine(config, tokenizer=TokenizerService(tokenizer()), publisher=publisher)
            self.engines[instance_id] = engine
            instances.append(InstanceConfig(id=instance_id, url=engine.url, model=config.model,
                                            kvs_endpoints=(endpoint,)))
        self.settings = self.settings.model_copy(update={"instances": instances})
        self.gateway = await (self._start or start_gateway)(self.settings, kvs_index=index, tokenizer=tokenizer())
        return self

    async def flushed(self) -> None:
        """Every engine's cache changes so far are in the index."""
        for engine in self.engines.values():
            await engine.engine.publication.flushed()

    async def __aexit__(self, *exc_info) -> None:
        if self.gateway is not None:
            await self.gateway.close()
        for engine in self.engines.values():
            await engine.close()


def gateway_records(caplog) -> list:
    """The log records of the gateway's own code and its HTTP server (not the test clients' loops)."""
    return [r for r in caplog.records if r.name.startswith(("kvgate", "aiohttp"))]
