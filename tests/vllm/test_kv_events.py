"""kvgate's keys and its events index against the KV events of two real vLLM engines.

e0 publishes int block hashes (vLLM's default) and serves a LoRA adapter, e1 publishes the 32-byte
digests (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0). Both have a 24-block KV cache, so a test can evict.
The last test restarts e0.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time

import aiohttp
import openai
import pytest
import yaml
import zmq
import zmq.asyncio

from kvgate.commands.doctor import diagnose
from kvgate.config.settings import InstanceConfig, Settings
from kvgate.doctor.probes import PROBE_CHAT, PROBE_TOOLS
from kvgate.doctor.results import CheckResult
from kvgate.engines.model import TINY_LORA_NAME, tiny_lora_dir
from kvgate.engines.vllm import VLLMEngine
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer
from kvgate.kvs_client.events.base import BlocksStored
from kvgate.kvs_client.events.keys import key_of
from kvgate.kvs_client.events.vllm import VllmDecoder
from tests.gateway_helpers import assert_nothing_in_flight, wait_until
from tests.vllm.fleet import KV_BLOCKS, MODEL, engine_sample, module_fleet

BLOCK = 256


@pytest.fixture(scope="module")
def engines(engine_venv, model_dir, tmp_path_factory):
    specs = [{"kv_events_int_hashes": True, "lora_adapters": {TINY_LORA_NAME: tiny_lora_dir(model_dir)}},
             {"kv_events_int_hashes": False}]
    with module_fleet(engine_venv, model_dir, tmp_path_factory.mktemp("vllm-events"), specs) as fleet:
        yield fleet


def settings_for(engines, **overrides) -> Settings:
    values = {
        "port": 0,
        "dispatch_policy": "cache_aware",
        "cache_aware_scheduling_min_tokens": 0,
        "kvs_backend": "kv_events",
        "health_check_interval_s": 0.5,
        "stats_poll_interval_s": 60.0,
        "instances": [
            InstanceConfig(id=f"e{i}", url=e.url, model=MODEL, kv_events_endpoint=e.spec.kv_events_endpoint,
                           kv_events_replay_endpoint=e.spec.kv_events_replay_endpoint,
                           lora_adapters={name: str(path) for name, path in e.spec.lora_adapters.items()})
            for i, e in enumerate(engines)
        ],
    }
    values.update(overrides)
    return Settings(**values)


@pytest.fixture
async def gateway(engines, engine_tokenizer):
    handle = await start_gateway(settings_for(engines), tokenizer=engine_tokenizer)
    await _until_following(handle.url, engines)
    yield handle
    await handle.close()


_warm_ups = iter(range(10_000, 20_000))


async def _until_following(url: str, engines, timeout_s: float = 20.0) -> None:
    """Until the gateway has received every engine's events. A SUB socket misses what is published
    before it has connected, so poke each still-silent engine with a one-block prompt of its own;
    the first batch received makes the gateway replay the engine's history."""
    probe = {"model": MODEL, "prompt": fresh_ids(0, BLOCK), "max_tokens": 1}
    deadline = time.monotonic() + timeout_s
    while True:
        plan = by_id(await post(url, "/debug/schedule", probe))
        silent = [i for i, engine in enumerate(engines) if plan[f"e{i}"]["events"]["state"] == "silent"]
        if not silent:
            return
        assert time.monotonic() < deadline, f"no KV events received from {silent}"
        for i in silent:
            await post(engines[i].url, "/v1/completions",
                       {"model": MODEL, "prompt": fresh_ids(next(_warm_ups), BLOCK + 1), "max_tokens": 1})
        await asyncio.sleep(0.3)


class EventTap:
    """A SUB socket on one engine: the block hashes of every BlockStored, decoded by kvgate's decoder."""

    def __init__(self, engine: VLLMEngine) -> None:
        self._socket = zmq.asyncio.Context.instance().socket(zmq.SUB)
        self._socket.connect(engine.spec.kv_events_endpoint)
        self._socket.setsockopt(zmq.SUBSCRIBE, b"")
        self._decoder = VllmDecoder()

    async def settle(self) -> None:
        await asyncio.sleep(0.5)  # a SUB socket misses what is published before it is connected

    async def stored_until(self, wanted: list[int], timeout_s: float = 10.0) -> list[int]:
        """Every stored hash, in order, until all of `wanted` were seen."""
        seen: list[int] = []
        deadline = time.monotonic() + timeout_s
        while not set(wanted) <= set(seen):
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"engine published {seen}, never all of {wanted}"
            frames = await asyncio.wait_for(self._socket.recv_multipart(), remaining)
            for event in self._decoder.decode(frames[2]).events:
                if isinstance(event, BlocksStored):
                    seen.extend(event.hashes)
        return seen

    def close(self) -> None:
        self._socket.close(linger=0)


async def post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(url + path, json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


def fresh_ids(seed: int, length: int) -> list[int]:
    return [1000 + (seed * 7919 + i * 104729) % 90000 for i in range(length)]


def engine_keys(plan: dict) -> list[int]:
    """The gateway's block keys (hex digest + "_0") as the index keys an engine's hashes map to."""
    return [key_of(bytes.fromhex(key.removesuffix("_0"))) for key in plan["block_keys"]]


def by_id(plan: dict) -> dict[str, dict]:
    return {entry["id"]: entry for entry in plan["instances"]}


@pytest.mark.parametrize("index", [0, 1], ids=["int-hashes", "bytes-hashes"])
async def test_block_keys_equal_the_engines_block_hashes(engines, gateway, index):
    """For token-id, text and chat (with tools) prompts: the gateway's keys are the engine's hashes."""
    engine = engines[index]
    long_text = " ".join(f"word{i}" for i in range(700)) + f" seed {index}"
    bodies = [
        {"model": MODEL, "prompt": fresh_ids(10 + index, 3 * BLOCK + 17), "max_tokens": 1},
        {"model": MODEL, "prompt": long_text, "max_tokens": 1},
        {"model": MODEL, "messages": [*PROBE_CHAT, {"role": "user", "content": long_text}], "tools": PROBE_TOOLS,
         "tool_choice": "none", "max_tokens": 1},
    ]
    tap = EventTap(engine)
    try:
        await tap.settle()
        for body in bodies:
            plan = await post(gateway.url, "/debug/schedule", body)
            ours = engine_keys(plan)
            assert len(ours) >= 2
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            await post(engine.url, path, body)  # straight to the engine: its own view of the prompt
            stored = await tap.stored_until(ours)
            assert [key_of(h) for h in stored[: len(ours)]] == ours
    finally:
        tap.close()


async def test_a_lora_adapters_keys_and_hits_equal_the_engines(engines, gateway):
    """vLLM mixes ("lora", name, path) into every block's hash, and a cache salt into the first: the
    gateway's keys for such requests are the engine's, and its predicted hits the engine's cached tokens."""
    engine = engines[0]
    prompt = fresh_ids(300, 3 * BLOCK + 11)
    bodies = [{"model": TINY_LORA_NAME, "prompt": prompt, "max_tokens": 1},
              {"model": TINY_LORA_NAME, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"},
              {"model": MODEL, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-a"}]
    tap = EventTap(engine)
    try:
        await tap.settle()
        for body in bodies:
            plan = await post(gateway.url, "/debug/schedule", body)
            ours = engine_keys(plan)
            assert [entry["id"] for entry in plan["instances"]] == (["e0"] if body["model"] != MODEL else ["e0", "e1"])
            await post(engine.url, "/v1/completions", body)
            stored = await tap.stored_until(ours)
            assert [key_of(h) for h in stored[: len(ours)]] == ours, body
    finally:
        tap.close()
    # Through the gateway: each request finds exactly what the engine reports cached, and no other's blocks.
    for body in [*bodies, {"model": TINY_LORA_NAME, "prompt": prompt, "max_tokens": 1, "cache_salt": "tenant-b"}]:
        plan = by_id(await post(gateway.url, "/debug/schedule", body))
        answer = await post(gateway.url, "/v1/completions", body)
        reported = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert reported == plan["e0"]["prefix_hit_tokens"], (body, answer["usage"])
        assert reported == (0 if body.get("cache_salt") == "tenant-b" else 3 * BLOCK), body
    await assert_nothing_in_flight(gateway)


async def test_a_served_prompt_shows_as_a_hit_on_its_engine_only(engines, gateway):
    prompt = fresh_ids(20, 4 * BLOCK + 30)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    before = by_id(await post(gateway.url, "/debug/schedule", body))
    assert before["e0"]["prefix_hit_tokens"] == before["e1"]["prefix_hit_tokens"] == 0
    await post(engines[0].url, "/v1/completions", body)
    answered = time.monotonic()
    while True:
        asked = time.monotonic()  # the index is read when the plan starts, not when its answer is back
        plan = by_id(await post(gateway.url, "/debug/schedule", body))
        if plan["e0"]["prefix_hit_tokens"]:
            break
        assert asked - answered < 5, plan
    lag_s = asked - answered
    assert plan["e0"]["prefix_hit_tokens"] == 4 * BLOCK
    assert plan["e0"]["hit_source"] == "events" and plan["e0"]["events"]["state"] == "synced"
    assert plan["e1"]["prefix_hit_tokens"] == 0
    # The engine publishes as it stores, before its answer is written: the hit is there at once
    # (within 0.1 s on an idle machine; the bound leaves room for a loaded one).
    assert lag_s < 0.5, f"the hit appeared {lag_s * 1000:.0f} ms after the answer"


async def test_an_evicted_prefix_is_no_longer_a_hit(engines, gateway):
    engine = engines[1]
    body = {"model": MODEL, "prompt": fresh_ids(30, 3 * BLOCK + 5), "max_tokens": 1}
    await post(engine.url, "/v1/completions", body)
    await _wait_hit(gateway.url, body, "e1", 3 * BLOCK)
    # More new blocks than the whole cache holds: the oldest, our prompt's, are evicted.
    for seed in range(40, 40 + KV_BLOCKS // 6 + 2):
        await post(engine.url, "/v1/completions", {"model": MODEL, "prompt": fresh_ids(seed, 15 * BLOCK // 2),
                                                   "max_tokens": 1})
    await _wait_hit(gateway.url, body, "e1", 0)


async def test_closed_loop_predicted_hits_equal_the_engines_cached_tokens(engines, gateway):
    """A shared-prefix workload through cache_aware: every answer's cached_tokens is the predicted hit."""
    documents = [fresh_ids(60 + d, 5 * BLOCK) for d in range(3)]
    bodies = [{"model": MODEL, "prompt": documents[i % 3] + fresh_ids(100 + i, 40 + 97 * i % 300), "max_tokens": 2}
              for i in range(12)]
    for body in bodies:
        plan = await post(gateway.url, "/debug/schedule", body)
        predicted = by_id(plan)[plan["selected"]]["prefix_hit_tokens"]
        answer = await post(gateway.url, "/v1/completions", body)
        reported = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        assert reported == predicted, (plan["selected"], predicted, answer["usage"])
        await asyncio.sleep(0.05)  # the answer's blocks reach the index
    metrics = await _gateway_metrics(gateway.url)
    assert metrics.get("kvgate_cached_tokens_disagreement_total", 0.0) == 0.0
    assert metrics["kvgate_reported_cached_tokens_total"] == metrics["kvgate_predicted_cached_tokens_total"] > 0
    await assert_nothing_in_flight(gateway)


async def _doctor(engines, tokenizer_service, **overrides) -> dict[str, CheckResult]:
    settings = settings_for(engines[:1], **overrides)
    results = await diagnose(settings, tokenizer_service, timeout_s=30.0, store_wait_s=5.0)
    return {result.check: result for result in results}


async def test_doctor_passes_against_a_real_engine_without_a_store(engines, tokenizer_service):
    results = await _doctor(engines, tokenizer_service)
    assert all(r.passed for r in results.values()), [r for r in results.values() if not r.passed]
    assert "block keys in KV events" in results and "chat tokens" in results


@pytest.mark.parametrize(("overrides", "cause"), [
    ({"hash_seed": "1"}, "seed '0'"),
    ({"kvs_chunk_size": 512}, "kvs_chunk_size is 512"),
], ids=["seed", "block-size"])
async def test_doctor_names_a_hashing_mismatch(engines, tokenizer_service, overrides, cause):
    failed = [r for r in (await _doctor(engines, tokenizer_service, **overrides)).values() if not r.passed]
    assert [r.check for r in failed] == ["block keys in KV events"]
    assert cause in failed[0].detail, failed[0]


async def test_doctor_names_a_tokenizer_or_template_mismatch(engines, model_dir, tmp_path):
    other = tmp_path / "tokenizer"
    other.mkdir()
    # Another tokenizer: one that lowercases (the probe text has capitals), with another chat template.
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    tokenizer["normalizer"] = {"type": "Lowercase"}
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    shutil.copy(model_dir / "tokenizer_config.json", other / "tokenizer_config.json")
    (other / "chat_template.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                                               "{% endfor %}")
    failed = {r.check: r for r in (await _doctor(engines, TokenizerService(load_tokenizer(str(other))))).values()
              if not r.passed}
    assert set(failed) == {"completion tokens", "chat tokens"}, failed
    assert "tokenizer" in failed["completion tokens"].fix and "chat template" in failed["chat tokens"].fix


def test_doctor_refuses_a_hash_algorithm_events_cannot_match(engines, tmp_path):
    config = tmp_path / "kvgate.yaml"
    engine = engines[0]
    config.write_text(yaml.safe_dump({
        "kvs_backend": "kv_events", "kvs_hash_algo": "sha256_hex",
        "instances": [{"id": "e0", "url": engine.url, "model": MODEL,
                       "kv_events_endpoint": engine.spec.kv_events_endpoint}]}))
    done = subprocess.run([sys.executable, "-m", "kvgate.cli", "doctor", "--config", str(config)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "kvs_hash_algo" in done.stderr, done.stderr


async def test_a_restarted_engine_loses_its_blocks_in_the_index(engines, gateway):
    engine = engines[0]
    body = {"model": MODEL, "prompt": fresh_ids(200, 2 * BLOCK + 9), "max_tokens": 1}
    await post(engine.url, "/v1/completions", body)
    await _wait_hit(gateway.url, body, "e0", 2 * BLOCK)
    engine.stop()
    restarted = VLLMEngine(engine.spec, engine.venv, engine.log_path.parent)
    engines[0] = restarted
    restarted.wait_ready()
    # Its sequence numbers start again at 0: the gateway drops what it held for it. (A batch sent
    # before the gateway's socket reconnected is missed: publish until one arrives.)
    deadline = time.monotonic() + 20.0
    for seed in range(201, 260):
        await post(restarted.url, "/v1/completions", {"model": MODEL, "prompt": fresh_ids(seed, BLOCK + 3),
                                                      "max_tokens": 1})
        await asyncio.sleep(0.3)
        plan = by_id(await post(gateway.url, "/debug/schedule", body))
        if plan["e0"]["prefix_hit_tokens"] == 0:
            break
        assert time.monotonic() < deadline, plan["e0"]
    assert plan["e0"]["events"]["state"] == "synced", plan["e0"]


async def _wait_hit(url: str, body: dict, instance: str, tokens: int, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        plan = by_id(await post(url, "/debug/schedule", body))
        if plan[instance]["prefix_hit_tokens"] == tokens:
            return
        assert time.monotonic() < deadline, plan[instance]
        await asyncio.sleep(0.05)


async def _gateway_metrics(url: str) -> dict[str, float]:
    from kvgate.engines.vllm import parse_metric_sums

    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        return parse_metric_sums(await response.text())


async def test_the_endpoint_picker_behind_envoy_routes_on_the_engines_events(engines, engine_tokenizer, tmp_path):
    """`kvgate epp` behind a real Envoy, in front of the real engines: a prompt one engine holds lands
    on it through Envoy, a stream arrives whole, its usage closes the loop, and the account is at zero."""
    pytest.importorskip("grpc", reason="the endpoint picker needs its extra: pip install 'kvgate[epp]'")
    from kvgate.gateway.ext_proc.server import start_picker
    from tests.envoy_proxy import envoy_binary, running_envoy

    envoy_binary()
    picker = await start_picker(settings_for(engines, epp_http_port=0), tokenizer=engine_tokenizer)
    try:
        await _until_following(picker.http_url, engines)
        async with running_envoy(picker.grpc_address, tmp_path) as envoy:
            api = openai.AsyncOpenAI(base_url=envoy.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            prompt = fresh_ids(400, 4 * BLOCK + 21)
            await post(engines[1].url, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
            await _wait_hit(picker.http_url, {"model": MODEL, "prompt": prompt, "max_tokens": 1}, "e1", 4 * BLOCK)
            before = await engine_sample(engines[1], "vllm:prefix_cache_hits_total")
            stream = await api.completions.create(model=MODEL, prompt=prompt, max_tokens=8, stream=True,
                                                  stream_options={"include_usage": True})
            chunks = [chunk async for chunk in stream]
            assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 4 * BLOCK
            assert sum(len(c.choices[0].text) for c in chunks if c.choices) > 0
            # The engine that held the prefix answered: its own counter moved by the whole hit.
            assert await engine_sample(engines[1], "vllm:prefix_cache_hits_total") - before == 4 * BLOCK
            metrics = await _gateway_metrics(picker.http_url)
            assert metrics["kvgate_predicted_cached_tokens_total"] == metrics["kvgate_reported_cached_tokens_total"]
            await wait_until(lambda: picker.gateway.account.total_inflight() == 0)
    finally:
        await picker.close()
