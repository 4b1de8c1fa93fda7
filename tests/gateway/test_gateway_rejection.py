"""Early rejection on the live path: 429 with Retry-After through real HTTP, the TTFT model's
terms on /debug/schedule, its calibration metrics, and max_tokens validation."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from kvgate.gateway.http.server import start_gateway
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    counter_value,
    gateway_settings,
    tokenizer,
)
from tests.openai_helpers import openai_client
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

pytestmark = pytest.mark.usefixtures("close_openai_clients")

COMPLETIONS = "/v1/completions"
LONG = "word " * 300  # ~300 tokens
# 1000 tokens/s: 300 tokens take ~0.3 s, a short prompt a few milliseconds.
SLOW_PREFILL = ((1000, 1.0),)


@pytest.fixture
async def upstream():
    started = await ScriptedUpstream("a", Script()).start()
    yield started
    await started.close()


async def post(url: str, path: str, body: dict) -> tuple[int, dict, aiohttp.typedefs.LooseHeaders]:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        return response.status, await response.json(), response.headers


@pytest.mark.parametrize("mode", ["early", "predictive"])
async def test_requests_predicted_over_the_ttft_slo_get_429_with_retry_after(upstream, mode):
    settings = gateway_settings({"a": upstream.url}, MODEL, ttft_slo_s=0.1, early_rejection=mode,
                                ttft_prefill_points=SLOW_PREFILL, ttft_calibration=False)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    try:
        status, payload, headers = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": LONG})
        assert status == 429
        assert payload["error"]["type"] == "rate_limit_error"
        assert payload["error"]["code"] == "ttft_slo_exceeded"
        assert int(headers["Retry-After"]) >= 1
        # The official client sees a RateLimitError carrying the header (no retries: it would honour it).
        client = openai_client(handle.url)
        with pytest.raises(openai.RateLimitError) as caught:
            await client.completions.create(model=MODEL, prompt=LONG, max_tokens=4)
        assert int(caught.value.response.headers["Retry-After"]) >= 1
        await client.close()
        assert counter_value(handle, "kvgate_admission_rejections_total") == 2
        # A short prompt fits the SLO and is served; nothing rejected ever reached the engine.
        status, _, _ = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": "short"})
        assert status == 200
        assert len(upstream.seen) == 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_decode_load_over_the_tbt_slo_is_rejected_and_none_admits_everything(upstream):
    # A decode step costs at least its 6 ms base: a 1 ms TBT SLO cannot be met.
    strict = gateway_settings({"a": upstream.url}, MODEL, tbt_slo_s=0.001, early_rejection="early")
    handle = await start_gateway(strict, tokenizer=tokenizer())
    try:
        status, payload, headers = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": "short"})
        assert status == 429 and payload["error"]["code"] == "tbt_slo_exceeded"
        assert int(headers["Retry-After"]) >= 1
    finally:
        await handle.close()
    # The same SLOs with --early-rejection none: served.
    lenient = gateway_settings({"a": upstream.url}, MODEL, tbt_slo_s=0.001, ttft_slo_s=0.1,
                               early_rejection="none", ttft_prefill_points=SLOW_PREFILL)
    handle = await start_gateway(lenient, tokenizer=tokenizer())
    try:
        status, _, _ = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": LONG})
        assert status == 200
    finally:
        await handle.close()


async def test_debug_schedule_shows_the_ttft_terms_and_served_requests_calibrate(upstream):
    settings = gateway_settings({"a": upstream.url}, MODEL, ttft_prefill_points=SLOW_PREFILL)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    try:
        status, plan, _ = await post(handle.url, "/debug/schedule", {"model": MODEL, "prompt": LONG})
        assert status == 200 and plan["rejection"] is None and plan["early_rejection"] == "none"
        (instance,) = plan["instances"]
        terms = instance["queue_s"] + instance["prefill_s"] + instance["transfer_s"]
        assert instance["predicted_ttft_s"] == pytest.approx(terms, abs=1e-5)
        # ~300 tokens at 1000 tokens/s, nothing queued, nothing to load.
        assert 0.2 < instance["prefill_s"] < 0.5
        assert instance["queue_s"] == 0 and instance["transfer_tokens"] == 0 and instance["local_hit_tokens"] == 0

        status, _, _ = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": LONG})
        assert status == 200
        assert counter_value(handle, "kvgate_ttft_prediction_error_seconds_count") == 1
        # The scripted engine answers far faster than the profile says: the compute factor drops.
        factor = counter_value(handle, "kvgate_ttft_calibration_factor", instance="a", term="compute")
        assert 0 < factor < 1
        assert counter_value(handle, "kvgate_ttft_calibration_observations", instance="a") == 1
    finally:
        await handle.close()


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", -1), ("max_tokens", 1.5), ("max_tokens", "16"), ("max_completion_tokens", True),
     ("max_completion_tokens", -3)],
)
async def test_max_tokens_must_be_a_positive_integer(upstream, field, value):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    try:
        for path, body in ((COMPLETIONS, {"model": MODEL, "prompt": "hi"}),
                           ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})):
            status, payload, _ = await post(handle.url, path, {**body, field: value})
            assert status == 400, (path, field, value)
            assert payload["error"]["param"] == field and field in payload["error"]["message"]
        status, _, _ = await post(handle.url, COMPLETIONS, {"model": MODEL, "prompt": "hi", field: 16})
        assert status == 200
        assert len(upstream.seen) == 1
    finally:
        await handle.close()
