"""kvgate's endpoint picker behind a real Envoy (ext_proc, FULL_DUPLEX_STREAMED, ORIGINAL_DST) in front
of mock engines: cache-aware picks, streams, refusals, and the load account back at zero on every path."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp
import openai
import pytest

pytest.importorskip("grpc", reason="the endpoint picker needs its extra: pip install 'kvgate[epp]'")

from kvgate.config.settings import Settings  # noqa: E402 (after the skip)
from kvgate.gateway.ext_proc.exchange import endpoint_address
from kvgate.gateway.ext_proc.server import PickerHandle, start_picker
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from tests.envoy_proxy import EnvoyProxy, envoy_binary, running_envoy
from tests.gateway_helpers import (
    EmbeddedFleet,
    closed_port_url,
    gateway_settings,
    read_events,
    tokenizer,
    wait_until,
)
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MODEL = "kvgate/mock-llm"
CHUNK = 16
PICKER = Settings(port=0, epp_http_port=0, kvs_chunk_size=CHUNK, dispatch_policy="cache_aware",
                  cache_aware_scheduling_min_tokens=0, health_check_interval_s=60.0, stats_poll_interval_s=60.0)
ENGINE = Settings(kvs_chunk_size=CHUNK)
PROMPT = list(range(1000, 1200))  # 12 full blocks and a partial one: a repeat finds 192 tokens cached


@pytest.fixture(autouse=True)
def _envoy_installed() -> None:
    envoy_binary()


@contextlib.asynccontextmanager
async def behind_envoy(tmp_path: Path, settings: Settings = PICKER, engines: Sequence[str] = ("e0", "e1"),
                       subset: Sequence[str] | None = None) -> AsyncIterator[tuple[EmbeddedFleet, EnvoyProxy]]:
    """Mock engines publishing their cache, the picker reading it, and Envoy in front."""
    async with contextlib.AsyncExitStack() as stack:
        fleet = await stack.enter_async_context(EmbeddedFleet(settings, dict.fromkeys(engines, ENGINE),
                                                              start=start_picker))
        yield fleet, await stack.enter_async_context(running_envoy(fleet.gateway.grpc_address, tmp_path, subset))


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


def counter(picker: PickerHandle, name: str, **labels: str) -> float:
    return picker.gateway.prometheus.get_sample_value(name, labels or None) or 0.0


def queries(fleet: EmbeddedFleet) -> dict[str, int]:
    """Prompt tokens each mock engine was asked to look up in its cache so far."""
    return {i: e.engine.core.stats().prefix_cache_queries for i, e in fleet.engines.items()}


async def served_by(fleet: EmbeddedFleet, api: openai.AsyncOpenAI, **request) -> list[str]:
    before = queries(fleet)
    await api.completions.create(model=MODEL, max_tokens=2, **request)
    await fleet.flushed()
    after = queries(fleet)
    return [i for i in after if after[i] != before[i]]


async def nothing_in_flight(picker: PickerHandle) -> None:
    """The account and the gauges on the picker's HTTP side are back at zero."""
    await wait_until(lambda: picker.gateway.account.total_inflight() == 0)
    async with aiohttp.ClientSession() as session, session.get(picker.http_url + "/metrics") as response:
        text = await response.text()
    gauges = [line for line in text.splitlines() if line.startswith("kvgate_inflight_requests{")]
    assert all(line.endswith(" 0.0") for line in gauges), gauges


async def test_a_repeated_long_prefix_lands_on_its_holder_through_envoy(tmp_path):
    async with behind_envoy(tmp_path) as (fleet, envoy):
        api = client(envoy.url)
        [holder] = await served_by(fleet, api, prompt=PROMPT)
        for _ in range(3):
            assert await served_by(fleet, api, prompt=PROMPT) == [holder]
        again = await api.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert again.usage.prompt_tokens_details.cached_tokens == 192
        picker = fleet.gateway
        # The answers went back through the picker: each one's usage checked the predicted hit.
        assert counter(picker, "kvgate_hit_comparisons_total", instance=holder, outcome="agree") == 5
        assert counter(picker, "kvgate_predicted_cached_tokens_total", instance=holder) == 4 * 192
        assert counter(picker, "kvgate_requests_total", route="/v1/completions", status="200") == 5
        await nothing_in_flight(picker)


async def test_a_stream_arrives_chunked_and_complete(tmp_path):
    async with behind_envoy(tmp_path, engines=("e0",)) as (fleet, envoy):
        api = client(envoy.url)
        messages = [{"role": "user", "content": "a prompt of several blocks " * 20}]
        whole = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=40)
        stream = await api.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, stream=True,
                                                   stream_options={"include_usage": True})
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert len(chunks) > 10 and text == whole.choices[0].message.content
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 40
        picker = fleet.gateway
        # Both answers' usage came through: a whole body's and a stream's last event.
        compared = sum(counter(picker, "kvgate_hit_comparisons_total", instance="e0", outcome=o)
                       for o in ("agree", "engine_higher", "gateway_higher"))
        assert compared == 2
        assert picker.gateway.prometheus.get_sample_value("kvgate_ttft_seconds_count") == 2
        await nothing_in_flight(picker)


async def test_the_pick_honours_envoys_subset_hint(tmp_path):
    async with EmbeddedFleet(PICKER, {"e0": ENGINE, "e1": ENGINE}, start=start_picker) as fleet:
        only_e1 = [endpoint_address(fleet.engines["e1"].url)]
        async with running_envoy(fleet.gateway.grpc_address, tmp_path, only_e1) as envoy:
            api = client(envoy.url)
            for _ in range(3):
                assert await served_by(fleet, api, prompt=PROMPT) == ["e1"]
        async with running_envoy(fleet.gateway.grpc_address, tmp_path, ["127.0.0.1:1"]) as envoy:
            with pytest.raises(openai.InternalServerError) as caught:
                await client(envoy.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
            assert caught.value.status_code == 503
            error = caught.value.body
            assert error["code"] == "no_healthy_instance" and "subset hint" in error["message"]
        await nothing_in_flight(fleet.gateway)


async def test_503_when_no_engine_can_serve_and_400_for_a_bad_body(tmp_path):
    settings = PICKER.model_copy(update={"admin_token": "secret"})
    async with behind_envoy(tmp_path, settings) as (fleet, envoy):
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer secret"}) as admin:
            for instance in fleet.engines:
                async with admin.post(f"{fleet.gateway.http_url}/admin/instances/{instance}/drain") as drained:
                    assert drained.status == 200
            async with admin.get(fleet.gateway.http_url + "/health") as health:
                assert health.status == 503
        api = client(envoy.url)
        with pytest.raises(openai.InternalServerError) as caught:
            await api.completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert caught.value.status_code == 503 and caught.value.body["code"] == "no_healthy_instance"
        async with aiohttp.ClientSession() as session:
            async with session.post(envoy.url + "/v1/completions", data=b"{not json") as response:
                assert response.status == 400
                assert (await response.json())["error"]["type"] == "invalid_request_error"
            async with session.post(envoy.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as response:
                assert response.status == 404 and (await response.json())["error"]["code"] == "model_not_found"
        assert queries(fleet) == {"e0": 0, "e1": 0}
        await nothing_in_flight(fleet.gateway)


async def test_429_from_early_rejection_with_retry_after(tmp_path):
    # A decode step costs at least its 6 ms base: a 1 ms TBT SLO cannot be met.
    settings = PICKER.model_copy(update={"tbt_slo_s": 0.001, "early_rejection": "early"})
    async with behind_envoy(tmp_path, settings, engines=("e0",)) as (fleet, envoy):
        with pytest.raises(openai.RateLimitError) as caught:
            await client(envoy.url).completions.create(model=MODEL, prompt="hello", max_tokens=2)
        assert caught.value.body["code"] == "tbt_slo_exceeded"
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        assert counter(fleet.gateway, "kvgate_admission_rejections_total") == 1
        assert queries(fleet) == {"e0": 0}
        await nothing_in_flight(fleet.gateway)


@contextlib.asynccontextmanager
async def slow_engines_behind_envoy(tmp_path: Path, count: int, **urls: str):
    """Mock engines that take their time to generate (a client can hang up mid-stream), plus `urls`."""
    engines = [await start_mock_engine(MockEngineConfig(time_scale=0.05), tokenizer=TokenizerService(tokenizer()))
               for _ in range(count)]
    upstreams = {**{f"e{i}": e.url for i, e in enumerate(engines)}, **urls}
    picker = await start_picker(gateway_settings(upstreams, MODEL, epp_http_port=0, forward_retries=0),
                                tokenizer=tokenizer())
    try:
        async with running_envoy(picker.grpc_address, tmp_path) as envoy:
            yield engines, picker, envoy
    finally:
        await picker.close()
        for engine in engines:
            await engine.close()


async def test_client_resets_mid_stream_leave_nothing_in_flight(tmp_path):
    async with slow_engines_behind_envoy(tmp_path, 1) as ([engine], picker, envoy):
        api = client(envoy.url)
        for _ in range(3):
            stream = await api.completions.create(model=MODEL, prompt="tell me a long story", max_tokens=400,
                                                  stream=True)
            await read_events(stream, 3)
            assert picker.gateway.account.total_inflight() == 1
            await stream.close()
        await wait_until(lambda: engine.engine.loop.num_open_requests == 0)
        await nothing_in_flight(picker)
        assert counter(picker, "kvgate_requests_total", route="/v1/completions", status="499") == 3
        # The picker still serves after the resets.
        done = await api.completions.create(model=MODEL, prompt="short", max_tokens=3)
        assert done.choices[0].text


async def test_an_engine_that_cannot_be_reached_fails_its_request_and_releases_it(tmp_path):
    async with slow_engines_behind_envoy(tmp_path, 0, dead=closed_port_url()) as (_, picker, envoy):
        api = client(envoy.url)
        for _ in range(2):
            with pytest.raises(openai.InternalServerError) as caught:
                await api.completions.create(model=MODEL, prompt="hello", max_tokens=2)
            assert caught.value.status_code == 503
        await nothing_in_flight(picker)
