"""The mock engine over real HTTP: prefix cache hits, queueing, cancellation, metrics, bad input.

Timing assertions compare modelled GPU time (hundreds of milliseconds) that the engine really
waits, never a machine's speed: each compares two requests measured in the same test.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.config.settings import Settings
from kvgate.engine_model import ServiceProfile
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine

MODEL = "kvgate/mock-llm"


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 32000) for _ in range(length)]


@pytest.fixture
async def engine_factory():
    handles = []

    async def make(**config):
        handle = await start_mock_engine(MockEngineConfig(**config))
        handles.append(handle)
        return handle

    yield make
    for handle in handles:
        await handle.close()


async def _stream_ttft(session: aiohttp.ClientSession, url: str, body: dict) -> tuple[float, dict]:
    """Time to the first text chunk, and the usage block of the stream."""
    started = time.monotonic()
    ttft = None
    usage: dict = {}
    body = {"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}}
    async with session.post(url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = __import__("json").loads(line[6:])
            if ttft is None and chunk["choices"]:
                ttft = time.monotonic() - started
            usage = chunk.get("usage") or usage
    assert ttft is not None
    return ttft, usage


async def test_repeated_prefix_hits_the_cache_and_answers_sooner(engine_factory):
    # time_scale 2: a 6K-token prefill is ~0.5 s of real waiting, a cached one ~0.03 s.
    engine = await engine_factory(time_scale=2.0)
    prompt = _prompt(6000, seed=1)
    async with aiohttp.ClientSession() as session:
        cold_ttft, cold = await _stream_ttft(session, engine.url, {"prompt": prompt, "max_tokens": 2})
        warm_ttft, warm = await _stream_ttft(
            session, engine.url, {"prompt": prompt + [7, 8, 9], "max_tokens": 2}
        )
    assert cold["prompt_tokens_details"]["cached_tokens"] == 0
    # All 23 full 256-token blocks of the shared 6000 tokens are reused.
    assert warm["prompt_tokens_details"]["cached_tokens"] == 23 * 256
    assert warm["prompt_tokens"] == 6003
    assert cold_ttft > 0.3 and warm_ttft < cold_ttft / 3


async def test_long_prompts_queue_behind_each_other(engine_factory):
    engine = await engine_factory(time_scale=1.0)
    async with aiohttp.ClientSession() as session:
        alone, _ = await _stream_ttft(session, engine.url, {"prompt": _prompt(8000, seed=2), "max_tokens": 1})
        first, second = await asyncio.gather(
            _stream_ttft(session, engine.url, {"prompt": _prompt(8000, seed=3), "max_tokens": 1}),
            _stream_ttft(session, engine.url, {"prompt": _prompt(8000, seed=4), "max_tokens": 1}),
        )
    # The engine's token budget is shared: the later prompt's first token waits for both prefills.
    assert second[0] > 1.6 * alone
    assert first[0] < second[0]


async def test_chat_role_chunk_waits_for_the_prefill():
    """As vLLM, nothing is streamed before the first token: gateways read the first chunk as it."""
    from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

    tokenizer = TokenizerService(load_tokenizer(), 64)
    handle = await start_mock_engine(MockEngineConfig(time_scale=2.0), tokenizer=tokenizer)
    words = " ".join(f"word{i}" for i in range(3000))  # several thousand tokens: ~0.5 s of prefill
    body = {"model": MODEL, "messages": [{"role": "user", "content": words}], "max_tokens": 2, "stream": True}
    try:
        async with aiohttp.ClientSession() as session:
            started = time.monotonic()
            async with session.post(handle.url + "/v1/chat/completions", json=body) as response:
                first_event = await response.content.readline()
                waited = time.monotonic() - started
                rest = await response.read()
    finally:
        await handle.close()
    assert b'"role":"assistant"' in first_event
    assert waited > 0.2
    assert rest.endswith(b"data: [DONE]\n\n")


async def test_openai_client_completions_and_chat(engine_factory):
    from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

    tokenizer = TokenizerService(load_tokenizer(), 64)
    handle = await start_mock_engine(MockEngineConfig(time_scale=0.1), tokenizer=tokenizer)
    client = openai.AsyncOpenAI(base_url=handle.url + "/v1", api_key="unused", max_retries=0, timeout=10)
    try:
        models = await client.models.list()
        assert [m.id for m in models.data] == [MODEL]

        text = "The quick brown fox jumps over the lazy dog. " * 40
        completion = await client.completions.create(model=MODEL, prompt=text, max_tokens=7)
        assert completion.usage.prompt_tokens == len(tokenizer.encode_prompt_sync(text))
        assert completion.usage.completion_tokens == 7
        assert completion.choices[0].finish_reason == "length"
        assert len(completion.choices[0].text.split()) == 7

        messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]
        chat = await client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=5)
        assert chat.usage.prompt_tokens == len(tokenizer.encode_chat_sync(messages))
        assert chat.choices[0].message.role == "assistant"
        assert len(chat.choices[0].message.content.split()) == 5

        pieces = []
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=6, stream=True, stream_options={"include_usage": True}
        )
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        # Same prompt, same engine seed: the same words, and this time the prompt's blocks are cached.
        assert "".join(pieces).split()[:5] == chat.choices[0].message.content.split()
        assert usage.completion_tokens == 6
        assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 256 * 256
    finally:
        await client.close()
        await handle.close()
        tokenizer.close()


async def test_generated_text_depends_on_seed_and_prompt_only(engine_factory):
    a = await engine_factory(time_scale=0.0, seed=1)
    b = await engine_factory(time_scale=0.0, seed=1)
    c = await engine_factory(time_scale=0.0, seed=2)
    body = {"model": MODEL, "prompt": _prompt(300, seed=5), "max_tokens": 12}
    async with aiohttp.ClientSession() as session:
        texts = []
        for engine in (a, b, c):
            async with session.post(engine.url + "/v1/completions", json=body) as response:
                texts.append((await response.json())["choices"][0]["text"])
    assert texts[0] == texts[1] != texts[2]


async def _until(condition, timeout_s: float = 2.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def test_client_disconnect_frees_the_engine(engine_factory):
    engine = await engine_factory(time_scale=1.0)
    core, loop = engine.engine.core, engine.engine.loop
    async with aiohttp.ClientSession() as session:
        # A streaming request that would decode for minutes, dropped after its first chunk.
        response = await session.post(
            engine.url + "/v1/completions",
            json={"model": MODEL, "prompt": _prompt(1000, 6), "max_tokens": 100000, "stream": True},
        )
        await response.content.readline()
        assert core.stats().num_running == 1
        response.close()
        assert await _until(lambda: not core.has_work() and loop.num_open_requests == 0)

        # A non-streaming request sharing the batch with a ~2 s prefill, abandoned by its client.
        blocker = asyncio.create_task(
            session.post(
                engine.url + "/v1/completions",
                json={"model": MODEL, "prompt": _prompt(30000, 7), "max_tokens": 1},
            )
        )
        with pytest.raises(TimeoutError):
            await session.post(
                engine.url + "/v1/completions",
                json={"model": MODEL, "prompt": _prompt(20000, 8), "max_tokens": 1},
                timeout=aiohttp.ClientTimeout(total=0.3),
            )
        assert await _until(lambda: core.stats().num_running == 1 and loop.num_open_requests == 1)
        # Its prefill left the batch: only the other prompt's remainder is still to compute.
        assert not blocker.done() and core.uncomputed_prefill_tokens() < 30000
        (await blocker).close()
        assert await _until(lambda: not core.has_work() and loop.num_open_requests == 0)
    stats = core.stats()
    assert stats.kv_cache_usage_ratio == 0.0
    assert stats.prefix_cache_queries == 1000 + 30000 + 20000


async def test_metrics_use_vllm_names(engine_factory):
    engine = await engine_factory(time_scale=0.0)
    prompt = _prompt(1100, seed=9)
    async with aiohttp.ClientSession() as session:
        for _ in range(2):
            async with session.post(
                engine.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
            ) as r:
                assert r.status == 200
        async with session.get(engine.url + "/metrics") as response:
            text = await response.text()
    samples = {
        sample.name: sample for family in text_string_to_metric_families(text) for sample in family.samples
    }
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
        assert samples[name].value == 0
        assert samples[name].labels == {"model_name": MODEL}
    assert samples["vllm:prefix_cache_queries_total"].value == 2 * 1100
    assert samples["vllm:prefix_cache_hits_total"].value == 4 * 256  # the second request's 4 full blocks
    assert samples["vllm:time_to_first_token_seconds_count"].value == 2


# A valid request, {"model": MODEL, "prompt": [1, 2]}, with one field made wrong: field -> its wrong values.
WRONG_FIELDS = {
    "prompt": ([], "", [1, -2], ["a", "b"], "text needs a tokenizer"),
    "max_tokens": (0, "3", 1_000_000),
    "stream": ("yes",),
    "n": (0,),
}
BAD_COMPLETION_BODIES = [
    (b"{not json", 400, None),
    (b"[1, 2]", 400, None),
    (b'{"prompt": [1, 2]}', 400, "model"),
    (b'{"model": "other", "prompt": [1, 2]}', 404, "model"),
    (b'{"model": "kvgate/mock-llm", "prompt": [1, 2], "n": 1099511627776, "stream": true}', 400, "n"),
    *((json.dumps({"model": MODEL, "prompt": [1, 2], field: value}).encode(), 400, field)
      for field, values in WRONG_FIELDS.items() for value in values),
]


@pytest.mark.parametrize(("body", "status", "param"), BAD_COMPLETION_BODIES)
async def test_bad_completion_requests_get_openai_errors(engine_factory, body, status, param):
    engine = await engine_factory(time_scale=0.0)
    async with (
        aiohttp.ClientSession() as session,
        session.post(engine.url + "/v1/completions", data=body) as response,
    ):
        assert response.status == status
        error = (await response.json())["error"]
    assert error["param"] == param and error["message"] and error["type"]
    assert engine.engine.loop.num_open_requests == 0


async def test_bad_chat_requests_and_unknown_routes(engine_factory):
    engine = await engine_factory(time_scale=0.0)
    async with aiohttp.ClientSession() as session:
        async with session.post(
            engine.url + "/v1/chat/completions", json={"model": MODEL, "messages": []}
        ) as response:
            assert response.status == 400
            assert (await response.json())["error"]["param"] == "messages"
        async with session.post(
            engine.url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"content": "x"}]}
        ) as r:
            assert r.status == 400
        # Peer routers probe these; a 404 in OpenAI shape is the right answer.
        for path in ("/server_info", "/model_info"):
            async with session.get(engine.url + path) as response:
                assert response.status == 404
                assert "error" in await response.json()
        async with session.get(engine.url + "/health") as response:
            assert response.status == 200


async def test_unknown_fields_are_ignored_and_tiny_caches_refuse_huge_prompts(engine_factory):
    engine = await engine_factory(
        time_scale=0.0, profile=ServiceProfile(cache_capacity_blocks=8), settings=Settings()
    )
    async with aiohttp.ClientSession() as session:
        body = {
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 2,
            "temperature": 0,
            "return_text_in_logprobs": True,
            "rid": "x",
            "priority": 3,
        }
        async with session.post(engine.url + "/v1/completions", json=body) as response:
            assert response.status == 200
        async with session.post(
            engine.url + "/v1/completions", json={"model": MODEL, "prompt": _prompt(9 * 256, 1)}
        ) as response:
            assert response.status == 400
            assert "context length" in (await response.json())["error"]["message"]


def test_block_size_must_match_the_chunk_size():
    with pytest.raises(ValueError, match="block size"):
        MockEngineConfig(profile=ServiceProfile(block_size=16), settings=Settings())


def test_command_serves_text_and_chat_then_stops_on_sigterm():
    import signal
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "mock-engine", "--port", "0", "--time-scale", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert "serving on http://127.0.0.1:" in line, process.stderr.read() if process.poll() else line
        url = line.split("serving on ")[1].split()[0]
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=10)
        chat = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.usage.completion_tokens == 3 and chat.usage.prompt_tokens > 1
        text = client.completions.create(model=MODEL, prompt="hello world", max_tokens=2)
        assert len(text.choices[0].text.split()) == 2
        client.close()
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)


async def test_tokenize_answers_as_vllm_with_the_gateways_ids():
    """vllm-router's cache_aware policy asks workers for ids via POST /tokenize."""
    from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

    tokenizer = TokenizerService(load_tokenizer(), 64)
    handle = await start_mock_engine(MockEngineConfig(time_scale=0.0), tokenizer=tokenizer)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why cache KV?"}]
    try:
        async with aiohttp.ClientSession() as session:
            async with session.post(
                handle.url + "/tokenize", json={"model": MODEL, "prompt": "hello world"}
            ) as r:
                text_answer = await r.json()
            async with session.post(
                handle.url + "/tokenize", json={"model": MODEL, "messages": messages}
            ) as r:
                chat_answer = await r.json()
            async with session.post(handle.url + "/tokenize", json={"model": "other", "prompt": "x"}) as r:
                unknown_model = r.status, await r.json()
            async with session.post(handle.url + "/tokenize", data=b"{not json") as r:
                malformed = r.status, await r.json()
    finally:
        await handle.close()
    assert text_answer["tokens"] == tokenizer.encode_prompt_sync("hello world")
    assert text_answer["count"] == len(text_answer["tokens"]) and text_answer["max_model_len"] > 0
    assert chat_answer["tokens"] == tokenizer.encode_chat_sync(messages)
    assert unknown_model[0] == 404 and unknown_model[1]["error"]["param"] == "model"
    assert malformed[0] == 400 and "error" in malformed[1]
