"""Prefill/decode through kvgate with real vLLM engines and NIXL (`pd_protocol: vllm`).

Two prefill engines and one decode engine, started once for the module. The decode engine must get
the prompt's KV by transfer (vLLM counts it as `external_kv_transfer`), never compute it.
"""

from __future__ import annotations

import asyncio
import os
import signal

import openai
import pytest

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import assert_nothing_in_flight, wait_until
from tests.vllm.fleet import MODEL, engine_sample, module_fleet, wait_engine_idle

_BY_SOURCE = "vllm:prompt_tokens_by_source_total"


@pytest.fixture(scope="module")
def engines(engine_venv, model_dir, tmp_path_factory):
    specs = [{"role": "prefill"}, {"role": "prefill"}, {"role": "decode"}]
    with module_fleet(engine_venv, model_dir, tmp_path_factory.mktemp("vllm-pd"), specs) as fleet:
        yield fleet


IDS = ["p0", "p1", "d0"]


def settings_for(engines, ids=IDS) -> Settings:
    return Settings(
        port=0,
        pd_protocol="vllm",
        health_check_interval_s=0.5,
        stats_poll_interval_s=60.0,
        instances=[InstanceConfig(id=i, url=e.url, model=MODEL, role=e.spec.role)
                   for i, e in zip(IDS, engines, strict=True) if i in ids],
    )


@pytest.fixture
async def gateway(engines, engine_tokenizer):
    handle = await start_gateway(settings_for(engines), tokenizer=engine_tokenizer)
    yield handle
    await handle.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


async def _warm_pair(engines, engine_tokenizer, prefill_id: str) -> None:
    """One request through a prefill engine and the decode engine. The decode engine's first pull from
    a prefill engine opens its NIXL side channel, which vLLM gives 5 s: on a loaded machine that
    first pull may fail, so it is tried up to three times before the tests measure anything."""
    warm = await start_gateway(settings_for(engines, [prefill_id, "d0"]), tokenizer=engine_tokenizer)
    try:
        # The first request also waits for the engines to compile for its shapes: a generous timeout.
        api = openai.AsyncOpenAI(base_url=warm.url + "/v1", api_key="unused", max_retries=0, timeout=400)
        for attempt in range(3):
            try:
                await api.completions.create(model=MODEL, prompt=[4900 + attempt] * 600, max_tokens=2)
                return
            except (openai.InternalServerError, openai.APITimeoutError):
                if attempt == 2:
                    raise
    finally:
        await warm.close()


async def test_the_decode_engine_streams_the_answer_from_transferred_kv(engines, gateway, engine_tokenizer):
    for prefill_id in ("p0", "p1"):
        await _warm_pair(engines, engine_tokenizer, prefill_id)
    decode = engines[2]
    before = {s: await engine_sample(decode, _BY_SOURCE, source=s) for s in ("external_kv_transfer", "local_compute")}
    prompt = [4000 + i for i in range(700)]
    stream = await client(gateway.url).completions.create(model=MODEL, prompt=prompt, max_tokens=12, stream=True,
                                                           stream_options={"include_usage": True},
                                                           extra_body={"ignore_eos": True})
    chunks = [chunk async for chunk in stream]
    # Random weights: a sampled token may be part of a UTF-8 character, its chunk's text empty. The
    # usage counts the tokens.
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 12
    assert sum(len(chunk.choices[0].text) for chunk in chunks if chunk.choices) > 0
    after = {s: await engine_sample(decode, _BY_SOURCE, source=s) for s in before}
    # All 700 prompt tokens reached the decode engine by KV transfer; it computed none of them
    # (the last prompt token is recomputed by vLLM's decode only when the transfer is short of it).
    assert after["external_kv_transfer"] - before["external_kv_transfer"] == len(prompt)
    assert after["local_compute"] == before["local_compute"]
    await assert_nothing_in_flight(gateway)


async def test_a_killed_prefill_engine_gets_a_new_pair(engines, gateway, engine_tokenizer):
    """The prefill engine a request was sent to dies before answering: the request is retried on the
    other prefill engine with the same decode engine, and every account returns to zero."""
    await _warm_pair(engines, engine_tokenizer, "p1")  # the pair the request must fall back to
    account = gateway.app[GATEWAY].account
    api = client(gateway.url)
    first = engines[0]
    os.killpg(first.process.pid, signal.SIGSTOP)
    # Two fresh prompts: the cache-aware ranking ties, and spreads them over both prefill engines.
    calls = [asyncio.create_task(api.completions.create(model=MODEL, prompt=[5000 + i] * 600, max_tokens=6))
             for i in range(2)]
    await wait_until(lambda: account.inflight("p0")[0] >= 1, timeout_s=20)
    first.kill()
    answers = await asyncio.gather(*calls)
    assert all(answer.usage.completion_tokens == 6 for answer in answers)
    await wait_engine_idle(engines[2])
    await assert_nothing_in_flight(gateway)
