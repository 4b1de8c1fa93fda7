"""Instances at run time: admin routes (auth, add, drain, remove), health ejection and readmission,
engine stats scraped into the account."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from kvgate.gateway.fleet.engine_stats import parse_engine_stats
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.scheduler.types import EngineStats
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    gateway_settings,
    read_streamed_completion,
    scripted_upstreams,
    tokenizer,
    wait_until,
)
from tests.scripted_upstream import MODEL, Script

TOKEN = "s3cret-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def upstreams():
    async with scripted_upstreams("a", "b") as started:
        yield started


async def call(url: str, method: str, path: str, json=None, headers=None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.request(method, url + path, json=json,
                                                                   headers=headers) as response:
        return response.status, await response.json()


async def complete(url: str, stream: bool = False) -> str:
    status, payload = await call(url, "POST", "/v1/completions", {"model": MODEL, "prompt": "p"})
    assert status == 200, payload
    return payload["choices"][0]["text"].split("-")[0]  # the answering upstream's name


async def test_admin_routes_are_absent_without_a_token(upstreams):
    handle = await start_gateway(gateway_settings({"a": upstreams["a"].url}, MODEL), tokenizer=tokenizer())
    try:
        status, payload = await call(handle.url, "GET", "/admin/instances", headers=ADMIN)
        assert status == 404 and "--admin-token" in payload["error"]["message"]
    finally:
        await handle.close()


async def test_admin_routes_need_the_right_bearer_token(upstreams):
    handle = await start_gateway(gateway_settings({"a": upstreams["a"].url}, MODEL, admin_token=TOKEN),
                                 tokenizer=tokenizer())
    try:
        assert (await call(handle.url, "GET", "/admin/instances"))[0] == 401
        assert (await call(handle.url, "GET", "/admin/instances", headers={"Authorization": "Bearer nope"}))[0] == 403
        assert (await call(handle.url, "DELETE", "/admin/instances/a", headers={"Authorization": "Basic x"}))[0] == 401
        status, payload = await call(handle.url, "GET", "/admin/instances", headers=ADMIN)
        assert status == 200 and [i["id"] for i in payload["instances"]] == ["a"]
    finally:
        await handle.close()


async def test_add_drain_remove_at_run_time(upstreams):
    handle = await start_gateway(
        gateway_settings({"a": upstreams["a"].url}, MODEL, admin_token=TOKEN,
                         dispatch_policy="round_robin"),
        tokenizer=tokenizer(),
    )
    try:
        new = {"id": "b", "url": upstreams["b"].url, "model": MODEL}
        status, payload = await call(handle.url, "POST", "/admin/instances", new, ADMIN)
        assert status == 201 and payload["id"] == "b"
        assert (await call(handle.url, "POST", "/admin/instances", new, ADMIN))[0] == 409
        bad = await call(handle.url, "POST", "/admin/instances", {"id": "c", "url": "ftp://x", "model": MODEL}, ADMIN)
        assert bad[0] == 400 and bad[1]["error"]["param"] == "url"
        # Without a pd_protocol a prefill or decode instance could never be served; bootstrap fields
        # belong to prefill instances. Both refused at the door, as at start-up.
        for role, extra in (("prefill", {}), ("decode", {}), ("neutral", {"bootstrap_port": 8998})):
            refused = await call(handle.url, "POST", "/admin/instances",
                                 {"id": "c", "url": upstreams["b"].url, "model": MODEL, "role": role, **extra}, ADMIN)
            assert refused[0] == 400 and refused[1]["error"]["param"] == "role", refused
        assert {await complete(handle.url) for _ in range(4)} == {"a", "b"}

        status, payload = await call(handle.url, "POST", "/admin/instances/a/drain", headers=ADMIN)
        assert status == 200 and payload["draining"] is True
        assert {await complete(handle.url) for _ in range(4)} == {"b"}

        status, _ = await call(handle.url, "DELETE", "/admin/instances/b", headers=ADMIN)
        assert status == 200
        assert (await call(handle.url, "DELETE", "/admin/instances/b", headers=ADMIN))[0] == 404
        # Only the drained instance is left: the model exists but nothing may take it.
        status, payload = await call(handle.url, "POST", "/v1/completions", {"model": MODEL, "prompt": "p"})
        assert status == 503
    finally:
        await handle.close()


async def test_drain_lets_in_flight_streams_finish(upstreams):
    upstreams["a"].script = Script(chunks=20, delay_s=0.02)
    handle = await start_gateway(gateway_settings({"a": upstreams["a"].url, "b": upstreams["b"].url}, MODEL,
                                                  admin_token=TOKEN, dispatch_policy="round_robin"),
                                 tokenizer=tokenizer())
    try:
        streaming = asyncio.create_task(read_streamed_completion(handle.url, MODEL))
        await wait_until(lambda: upstreams["a"].open_streams == 1)
        _, payload = await call(handle.url, "POST", "/admin/instances/a/drain", headers=ADMIN)
        assert payload["inflight_requests"] == 1
        assert await complete(handle.url) == "b"
        body = await streaming
        assert b"a-19" in body and body.endswith(b"data: [DONE]\n\n")
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_health_checks_eject_and_readmit(upstreams):
    handle = await start_gateway(
        gateway_settings({"a": upstreams["a"].url, "b": upstreams["b"].url}, MODEL,
                         health_check_interval_s=0.05, health_check_failures_to_eject=2),
        tokenizer=tokenizer(),
    )
    registry = handle.app[GATEWAY].registry
    prometheus = handle.app[GATEWAY].prometheus
    try:
        upstreams["a"].script.health_status = 503
        await wait_until(lambda: not registry.get("a").healthy)
        assert prometheus.get_sample_value("kvgate_instance_healthy", {"instance": "a"}) == 0
        assert {await complete(handle.url) for _ in range(4)} == {"b"}
        upstreams["a"].script.health_status = 200
        await wait_until(lambda: registry.get("a").healthy)
        assert prometheus.get_sample_value("kvgate_instance_healthy", {"instance": "a"}) == 1
    finally:
        await handle.close()


VLLM_METRICS = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{le="0.001",model_name="m"} 0.0
"""
SGLANG_METRICS = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.75
"""


def test_engine_stats_parse_vllm_and_sglang_names():
    assert parse_engine_stats(VLLM_METRICS) == EngineStats(5, 4, 0.5)
    assert parse_engine_stats(SGLANG_METRICS) == EngineStats(7, 1, 0.75)
    legacy = "vllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.125\n"
    assert parse_engine_stats(legacy) == EngineStats(1, 0, 0.125)
    assert parse_engine_stats("unrelated_metric 1\n") is None
    assert parse_engine_stats("vllm:num_requests_running{broken 1\n") is None


async def test_engine_stats_are_scraped_into_the_load(upstreams):
    upstreams["a"].script.metrics_text = VLLM_METRICS
    upstreams["b"].script.metrics_text = SGLANG_METRICS
    handle = await start_gateway(
        gateway_settings({"a": upstreams["a"].url, "b": upstreams["b"].url}, MODEL, stats_poll_interval_s=0.05),
        tokenizer=tokenizer(),
    )
    account = handle.app[GATEWAY].account
    try:
        await wait_until(lambda: account.load("a").num_requests == 9 and account.load("b").num_requests == 8)
        assert account.load("a").kv_cache_usage_ratio == 0.5
        assert account.load("b").num_waiting_requests == 1
        # Least load compares waiting requests before running ones: b has 1 waiting, a has 4.
        assert await complete(handle.url) == "b"
    finally:
        await handle.close()
