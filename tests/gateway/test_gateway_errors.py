"""Bad input gets a clean OpenAI-style 4xx, never a 500; refusals (503, 429) are explained."""

from __future__ import annotations

import aiohttp
import openai
import pytest

from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    gateway_settings,
    tokenizer,
    wait_until,
)
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream


@pytest.fixture
async def gateway():
    upstream = await ScriptedUpstream("a", Script()).start()
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, max_body_bytes=64 * 1024),
                                 tokenizer=tokenizer())
    handle.upstream = upstream
    yield handle
    await handle.close()
    await upstream.close()


async def send(url: str, method: str, path: str, data: bytes | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session, session.request(method, url + path, data=data,
                                                                   headers=headers) as response:
        assert response.content_type == "application/json"
        return response.status, await response.json()


def assert_openai_error(payload: dict, error_type: str) -> dict:
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == error_type and error["message"]
    return error


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize("path,data,param,fragment", [
    (COMPLETIONS, b"{not json", None, "not valid JSON"),
    (COMPLETIONS, b"", None, "empty"),
    (COMPLETIONS, b"[1, 2]", None, "JSON object"),
    (COMPLETIONS, b'{"prompt": "x"}', "model", "model"),
    (COMPLETIONS, b'{"model": 12, "prompt": "x"}', "model", "string"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": ""}', "prompt", "empty"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": []}', "prompt", "empty"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": [1, "2"]}', "prompt", "token ids"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": [-1]}', "prompt", "token ids"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": ["a", 5]}', "prompt", "list of either"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": ["a", ""]}', "prompt", "empty"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": ["a", [1]]}', "prompt", "not both"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": [[1], "a"]}', "prompt", "not both"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": {"text": "x"}}', "prompt", "string"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "stream": "yes"}', "stream", "boolean"),
    (CHAT, b'{"model": "scripted-model", "messages": []}', "messages", "at least 1"),
    (CHAT, b'{"model": "scripted-model"}', "messages", "required"),
    (CHAT, b'{"model": "scripted-model", "messages": "hello"}', "messages", "list"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"content": "x"}]}', "messages", "role"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": 5}]}', "messages", "string"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "wizard", "content": "x"}]}', "messages",
     "unsupported message role"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": [{"text": "x"}]}]}',
     "messages", "'type'"),
    # The fields that shape scheduling and the relay are type-checked, on the quick path and the full one.
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "max_tokens": "3"}', "max_tokens", "positive"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": ["x", "y"], "max_tokens": 0}', "max_tokens", "positive"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], '
           b'"max_completion_tokens": 2.5}', "max_completion_tokens", "positive"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "n": true}', "n", "positive"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], "n": 0}', "n", "positive"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "n": 129}', "n", "at most 128"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], "n": 1099511627776}',
     "n", "at most 128"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "stream_options": {"include_usage": true}}',
     "stream_options", "only allowed when 'stream' is true"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "stream": true, "stream_options": []}',
     "stream_options", "object"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], "stream": true, '
           b'"stream_options": {"include_usage": "yes"}}', "stream_options", "boolean"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], "tools": {}}',
     "tools", "list of objects"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], '
           b'"chat_template_kwargs": [1]}', "chat_template_kwargs", "object"),
    (CHAT, b'{"model": "scripted-model", "messages": [{"role": "user", "content": "x"}], '
           b'"continue_final_message": true}', "continue_final_message", "cannot both be true"),
    (COMPLETIONS, b'{"model": "scripted-model", "prompt": "x", "add_special_tokens": 1}', "add_special_tokens",
     "boolean"),
])
async def test_invalid_bodies_are_400(gateway, path, data, param, fragment):
    status, payload = await send(gateway.url, "POST", path, data)
    assert status == 400
    error = assert_openai_error(payload, "invalid_request_error")
    assert error["param"] == param
    assert fragment.lower() in error["message"].lower()
    assert gateway.upstream.seen == []


async def test_unknown_model_is_404(gateway):
    async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="x", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as caught:
            await client.completions.create(model="no-such-model", prompt="hi")
    assert caught.value.body["code"] == "model_not_found"


async def test_body_over_the_limit_is_413(gateway):
    huge = b'{"model": "scripted-model", "prompt": "' + b"x" * (80 * 1024) + b'"}'
    status, payload = await send(gateway.url, "POST", COMPLETIONS, huge)
    assert status == 413
    assert_openai_error(payload, "invalid_request_error")
    assert "65536" in payload["error"]["message"]


async def test_unknown_routes_and_methods_answer_openai_errors(gateway):
    status, payload = await send(gateway.url, "GET", "/v1/nothing-here")
    assert status == 404
    assert_openai_error(payload, "not_found_error")
    status, payload = await send(gateway.url, "GET", COMPLETIONS)
    assert status == 405
    assert_openai_error(payload, "invalid_request_error")


async def test_no_routable_instance_is_503():
    handle = await start_gateway(
        gateway_settings({"down": closed_port_url()}, MODEL, health_check_interval_s=0.05,
                         health_check_failures_to_eject=1),
        tokenizer=tokenizer(),
    )
    try:
        registry = handle.app[GATEWAY].registry
        await wait_until(lambda: not registry.get("down").healthy)
        # Every instance ejected: tried anyway (panic routing), and its failure is a 502.
        status, payload = await send(handle.url, "POST", COMPLETIONS, b'{"model": "scripted-model", "prompt": "x"}')
        assert status == 502
        assert assert_openai_error(payload, "server_error")["code"] == "upstream_unavailable"
        registry.drain("down")  # draining instances are never tried
        status, payload = await send(handle.url, "POST", COMPLETIONS, b'{"model": "scripted-model", "prompt": "x"}')
        assert status == 503
        assert assert_openai_error(payload, "server_error")["code"] == "no_healthy_instance"
    finally:
        await handle.close()


async def test_admission_refuses_requests_predicted_over_the_slo():
    upstream = await ScriptedUpstream("a", Script()).start()
    # 1000 tokens/s and a 0.1 s SLO: anything over 100 uncached tokens is refused, shorter passes.
    handle = await start_gateway(
        gateway_settings({"a": upstream.url}, MODEL, ttft_slo_s=0.1, prefill_tokens_per_s=1000),
        tokenizer=tokenizer(),
    )
    try:
        status, payload = await send(handle.url, "POST", COMPLETIONS,
                                     b'{"model": "scripted-model", "prompt": "' + b"word " * 300 + b'"}')
        assert status == 429
        error = assert_openai_error(payload, "rate_limit_error")
        assert error["code"] == "ttft_slo_exceeded" and "SLO" in error["message"]
        assert counter_value(handle, "kvgate_admission_rejections_total") == 1
        status, _ = await send(handle.url, "POST", COMPLETIONS, b'{"model": "scripted-model", "prompt": "short"}')
        assert status == 200
        assert len(upstream.seen) == 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await upstream.close()


async def test_errors_are_counted_by_route_and_status(gateway):
    await send(gateway.url, "POST", COMPLETIONS, b"{oops")
    await send(gateway.url, "GET", "/no/such/path")
    assert counter_value(gateway, "kvgate_requests_total", route="/v1/completions", status="400") == 1
    assert counter_value(gateway, "kvgate_requests_total", route="unmatched", status="404") == 1
