"""Client API keys on /v1/*: 401 without a valid key, per-key rate limit and in-flight cap with
429 + Retry-After, key names (never keys) in logs and metrics, and gateway keys never sent to engines."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import openai
import pytest

from kvgate.config.api_keys import load_api_keys
from kvgate.config.loader import ConfigError, load_settings
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

KEY_A = "a" * 8 + "-team-a-0123456789abcdef"
KEY_B = "b" * 8 + "-bare-key-0123456789abcdef"


@pytest.fixture
def keys_file(tmp_path):
    path = tmp_path / "keys"
    path.write_text(f"# clients of this gateway\n\nteam-a:{KEY_A}\n   {KEY_B}  \n")
    return str(path)


@pytest.fixture
async def upstream():
    started = await ScriptedUpstream("a", Script()).start()
    yield started
    await started.close()


def client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai_client(url, api_key=key)


def test_the_keys_file_names_keys_and_refuses_bad_lines(tmp_path, keys_file):
    keys = load_api_keys(keys_file)
    assert [k.name for k in keys] == ["team-a", keys[1].name] and keys[1].name.startswith("key-")
    assert [k.key for k in keys] == [KEY_A, KEY_B]
    assert KEY_A not in repr(keys)
    for text, complaint in ((f"x:{KEY_A}\ny:{KEY_A}\n", "duplicated"), ("x:short\n", "at least 16"),
                            ("# nothing\n", "no key"), (f"bad name:{KEY_A}\n", "name")):
        path = tmp_path / "bad"
        path.write_text(text)
        with pytest.raises(ConfigError, match="--api-keys-file") as error:
            load_settings({"api_keys_file": str(path)}, environ={})
        assert complaint in str(error.value) and KEY_A not in str(error.value)
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({"api_keys_file": str(tmp_path / "missing")}, environ={})


async def test_v1_needs_a_valid_key_and_engines_never_see_it(upstream, keys_file, caplog):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  access_log=True), tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.INFO):
            for key in ("wrong-key-0123456789abcdef", KEY_A + "x", KEY_A[:-1]):
                with pytest.raises(openai.AuthenticationError) as refused:
                    await client(handle.url, key).completions.create(model=MODEL, prompt="hi")
                assert refused.value.body["code"] == "invalid_api_key"
            async with aiohttp.ClientSession() as session:
                async with session.get(handle.url + "/v1/models", headers={"Authorization": "Basic " + KEY_A}) as r:
                    assert r.status == 401 and r.headers["WWW-Authenticate"] == "Bearer"
                async with session.post(handle.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"}) as r:
                    assert r.status == 401 and (await r.json())["error"]["type"] == "authentication_error"
                for path in ("/health", "/livez"):  # not behind client keys
                    async with session.get(handle.url + path) as r:
                        assert r.status == 200
                # With keys, debug routes default to the admin token (none configured here: 404).
                async with session.get(handle.url + "/metrics") as r:
                    assert r.status == 404
            for key in (KEY_A, KEY_B):
                answer = await client(handle.url, key).completions.create(model=MODEL, prompt="hi")
                assert answer.choices[0].text.startswith("a-")
            models = await client(handle.url, KEY_A).models.list()
            assert [m.id for m in models.data] == [MODEL]
        assert len(upstream.seen) == 2 and all("Authorization" not in s.headers for s in upstream.seen)
        assert counter_value(handle, "kvgate_api_key_unauthorized_total") == 5
        assert counter_value(handle, "kvgate_api_key_requests_total", key="team-a", outcome="accepted") == 2
        logged = [r.getMessage() for r in caplog.records]
        assert any('"api_key":"team-a"' in line for line in logged)
        assert not any(KEY_A in line or KEY_B in line for line in logged)
    finally:
        await handle.close()


async def test_engines_get_the_engine_key_not_the_clients(upstream, keys_file):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  engine_api_key="engine-secret"), tokenizer=tokenizer())
    try:
        await client(handle.url, KEY_A).completions.create(model=MODEL, prompt="hi")
        assert upstream.seen[-1].headers["Authorization"] == "Bearer engine-secret"
    finally:
        await handle.close()


async def test_rate_limit_answers_429_with_retry_after(upstream, keys_file):
    # 2 at once, then one per 100 s: the third request in a row is over the limit whatever the clock.
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  api_key_rate_limit_rps=0.01, api_key_rate_limit_burst=2),
                                 tokenizer=tokenizer())
    try:
        a = client(handle.url, KEY_A)
        for _ in range(2):
            await a.completions.create(model=MODEL, prompt="hi")
        with pytest.raises(openai.RateLimitError) as limited:
            await a.completions.create(model=MODEL, prompt="hi")
        assert limited.value.body["code"] == "rate_limited"
        assert 90 <= int(limited.value.response.headers["Retry-After"]) <= 100
        await client(handle.url, KEY_B).completions.create(model=MODEL, prompt="hi")  # other keys unaffected
        assert counter_value(handle, "kvgate_api_key_requests_total", key="team-a", outcome="rate_limited") == 1
        assert len(upstream.seen) == 3
    finally:
        await handle.close()


async def test_inflight_cap_per_key(upstream, keys_file):
    upstream.script.chunks, upstream.script.delay_s = 20, 0.05
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, api_keys_file=keys_file,
                                                  api_key_max_inflight=1, debug_routes="public"), tokenizer=tokenizer())
    try:
        a = client(handle.url, KEY_A)
        stream = await a.completions.create(model=MODEL, prompt="hi", stream=True)
        first = await anext(aiter(stream))
        assert first.choices[0].text == "a-0 "
        with pytest.raises(openai.RateLimitError) as limited:
            await a.completions.create(model=MODEL, prompt="hi")
        assert limited.value.body["code"] == "inflight_limited"
        assert limited.value.response.headers["Retry-After"] == "1"
        other = await client(handle.url, KEY_B).completions.create(model=MODEL, prompt="hi")  # not shared
        assert other.choices[0].text
        texts = [chunk.choices[0].text async for chunk in stream]
        assert len(texts) == 19
        await a.completions.create(model=MODEL, prompt="hi")  # the slot is free again
        # A client that hangs up frees its slot too.
        stream = await a.completions.create(model=MODEL, prompt="hi", stream=True)
        await anext(aiter(stream))
        await stream.close()
        await asyncio.sleep(0)
        await assert_nothing_in_flight(handle)
        await a.completions.create(model=MODEL, prompt="hi")
        assert counter_value(handle, "kvgate_api_key_requests_total", key="team-a", outcome="inflight_limited") == 1
    finally:
        await handle.close()


async def test_without_keys_the_clients_authorization_still_reaches_engines(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL), tokenizer=tokenizer())
    try:
        await client(handle.url, "engine-key").completions.create(model=MODEL, prompt="hi")
        assert upstream.seen[-1].headers["Authorization"] == "Bearer engine-key"
    finally:
        await handle.close()
