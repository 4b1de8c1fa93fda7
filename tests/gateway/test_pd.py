"""Prefill/decode disaggregation end to end: the gateway in front of prefill and decode mock engines
that implement SGLang's and vLLM's hand-offs over real HTTP, driven by the official openai client."""

from __future__ import annotations

import logging
import socket

import aiohttp
import openai
import pytest

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.gateway.state import GATEWAY
from kvgate.mock_engine.pd import PDRole
from kvgate.mock_engine.server import MockEngineConfig, MockEngineHandle, start_mock_engine
from tests.gateway_helpers import (
    assert_hang_up_released,
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    read_events,
    tokenizer,
    wait_until,
)
from tests.openai_helpers import openai_client
from tests.scripted_upstream import Script, ScriptedUpstream

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MODEL = MockEngineConfig().model
CHAT = [{"role": "user", "content": "Name three rivers."}]
PROMPT = "Once upon a time " * 80  # more than one 256-token block


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def engine(role: str, protocol: str, bootstrap_port: int | None = None) -> MockEngineHandle:
    config = MockEngineConfig(time_scale=0.02, pd=PDRole(role, protocol, 1e6, bootstrap_port))
    return await start_mock_engine(config, tokenizer=TokenizerService(tokenizer()), name=f"{role}-{protocol}")


def instance(id_: str, url: str, role: str, bootstrap_port: int | None = None) -> InstanceConfig:
    return InstanceConfig(id=id_, url=url, model=MODEL, role=role, bootstrap_port=bootstrap_port)


def settings(protocol: str, instances: list[InstanceConfig], **overrides) -> Settings:
    return Settings(port=0, health_check_interval_s=60.0, stats_poll_interval_s=60.0, pd_protocol=protocol,
                    instances=instances, **overrides)


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


@pytest.fixture(params=["sglang", "vllm"])
async def fleet(request):
    """One prefill and one decode engine of the protocol, and a gateway in front of them."""
    protocol = request.param
    bootstrap = free_port() if protocol == "sglang" else None
    prefill, decode = await engine("prefill", protocol, bootstrap), await engine("decode", protocol)
    gateway = await start_gateway(
        settings(protocol, [instance("p0", prefill.url, "prefill", bootstrap), instance("d0", decode.url, "decode")]),
        tokenizer=tokenizer())
    yield protocol, prefill, decode, gateway, bootstrap
    await gateway.close()
    for handle in (prefill, decode):
        await handle.close()


CALLS = [
    ("completion", False, lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7)),
    ("chat", False, lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7)),
    ("completion", True, lambda c: c.completions.create(model=MODEL, prompt=PROMPT, max_tokens=7, stream=True)),
    ("chat", True, lambda c: c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=7, stream=True)),
]


@pytest.mark.parametrize(("kind", "stream", "call"), CALLS, ids=[f"{k}-stream={s}" for k, s, _ in CALLS])
async def test_each_engine_receives_its_hand_off_and_the_decode_answers(fleet, kind, stream, call):
    protocol, prefill, decode, gateway, bootstrap = fleet
    answer = await call(client(gateway.url))
    if stream:
        text = "".join([(c.choices[0].text if kind == "completion" else c.choices[0].delta.content or "")
                        async for c in answer if c.choices])
    else:
        text = answer.choices[0].text if kind == "completion" else answer.choices[0].message.content
    assert len(text.split()) == 7  # the decode engine generated max_tokens words
    [prefill_body], [decode_body] = list(prefill.engine.received), list(decode.engine.received)
    original = {"model": MODEL, "max_tokens": 7, **({"prompt": PROMPT} if kind == "completion" else {"messages": CHAT}),
                **({"stream": True} if stream else {})}
    if protocol == "sglang":
        room = prefill_body["bootstrap_room"]
        assert isinstance(room, int) and 0 <= room < 2**63
        expected = {**original, "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": room}
        assert prefill_body == expected and decode_body == expected
    else:
        assert prefill_body == {**original, "stream": False, "max_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}}
        params = decode_body.pop("kv_transfer_params")
        assert decode_body == original
        port = int(prefill.url.rsplit(":", 1)[1])
        assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-vllm",
                          "remote_block_ids": params["remote_block_ids"], "remote_host": "127.0.0.1",
                          "remote_port": port, "tp_size": 1}
    if kind == "completion":
        # The prompt's full blocks reached the decode engine's cache from the prefill engine: it
        # computed none of them, and the prefill engine (cold) computed them all.
        full_blocks_tokens = len(tokenizer().encode(PROMPT)) // 256 * 256
        assert full_blocks_tokens > 0
        assert decode.engine.core.stats().prefix_cache_hits == full_blocks_tokens
        assert prefill.engine.core.stats().prefix_cache_hits == 0
    await assert_nothing_in_flight(gateway)
    assert len(gateway.app[GATEWAY].decode_ledger) == 0


async def test_decode_engines_refuse_requests_without_a_hand_off(fleet):
    protocol, _, decode, _, _ = fleet
    with pytest.raises(openai.BadRequestError, match="decode instance"):
        await client(decode.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)


async def test_the_debug_route_shows_both_choices_with_their_rankings(fleet):
    _, _, _, gateway, _ = fleet
    async with aiohttp.ClientSession() as session, session.post(
            gateway.url + "/debug/schedule", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 5}) as answer:
        shown = await answer.json()
    assert shown["pd"] is True and shown["skip_prefill"] is False
    assert shown["prefill"]["ranking"] == ["p0"] and shown["prefill"]["selected"] == "p0"
    assert shown["decode"]["ranking"] == ["d0"]
    assert set(shown["decode"]["instances"][0]["metrics"]) == {
        "predicted_decode_tokens", "kv_cache_usage_ratio", "num_requests"}


async def test_client_hang_up_mid_stream_cancels_both_and_accounts_return_to_zero(fleet):
    _, prefill, decode, gateway, _ = fleet
    stream = await client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3000, stream=True)
    await read_events(stream, 3)
    # The decode is generating; the gateway holds one decode entry with its predicted tokens.
    assert gateway.app[GATEWAY].decode_ledger.tokens == {"d0": 3000}
    await stream.close()
    await assert_hang_up_released(gateway, decode.engine, prefill.engine)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
@pytest.mark.parametrize("dead", ["prefill", "decode"])
async def test_a_dead_instance_is_retried_with_a_new_pair(protocol, dead):
    bootstrap = free_port() if protocol == "sglang" else None
    prefill, decode = await engine("prefill", protocol, bootstrap), await engine("decode", protocol)
    dead_url = closed_port_url()
    instances = [instance("p-live", prefill.url, "prefill", bootstrap), instance("d-live", decode.url, "decode")]
    if dead == "prefill":
        instances.append(instance("a-dead", dead_url, "prefill", free_port() if protocol == "sglang" else None))
    else:
        instances.append(instance("a-dead", dead_url, "decode"))
    # round_robin from a cold start ranks "a-dead" first (id order), so the first pair fails.
    gateway = await start_gateway(settings(protocol, instances, dispatch_policy="round_robin"), tokenizer=tokenizer())
    try:
        plan_first = gateway.app[GATEWAY]
        answer = await client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert len(answer.choices[0].text.split()) == 4
        assert counter_value(gateway, "kvgate_forward_retries_total", instance="a-dead") == 1
        if protocol == "sglang":
            prefill_rooms = [b["bootstrap_room"] for b in prefill.engine.received]
            [decode_room] = [b["bootstrap_room"] for b in decode.engine.received]
            assert prefill_rooms[-1] == decode_room  # the live pair met in one room
            assert len(set(prefill_rooms)) == len(prefill_rooms)  # every try its own room
        await assert_nothing_in_flight(gateway)
        assert len(plan_first.decode_ledger) == 0
    finally:
        await gateway.close()
        for handle in (prefill, decode):
            await handle.close()


async def test_short_uncached_prompts_skip_the_prefill_instance():
    prefill, decode = await engine("prefill", "vllm"), await engine("decode", "vllm")
    instances = [instance("p0", prefill.url, "prefill"), instance("d0", decode.url, "decode")]
    gateway = await start_gateway(settings("vllm", instances, pd_skip_prefill_below_tokens=40), tokenizer=tokenizer())
    try:
        c = client(gateway.url)
        short = await c.completions.create(model=MODEL, prompt="hello there", max_tokens=3)
        assert len(short.choices[0].text.split()) == 3
        assert list(prefill.engine.received) == []
        assert list(decode.engine.received)[-1]["kv_transfer_params"] == {
            "do_remote_decode": False, "do_remote_prefill": False}
        long_prompt = "a long prompt " * 30  # well over 40 tokens: prefilled remotely
        await c.completions.create(model=MODEL, prompt=long_prompt, max_tokens=3)
        assert len(prefill.engine.received) == 1
        assert list(decode.engine.received)[-1]["kv_transfer_params"]["do_remote_prefill"] is True
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()
        for handle in (prefill, decode):
            await handle.close()


async def test_vllm_mooncake_connector_fields_are_filled_by_the_gateway():
    bootstrap = free_port()
    prefill, decode = await engine("prefill", "vllm", bootstrap), await engine("decode", "vllm")
    instances = [instance("p0", prefill.url, "prefill", bootstrap), instance("d0", decode.url, "decode")]
    gateway = await start_gateway(settings("vllm", instances), tokenizer=tokenizer())
    try:
        answer = await client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=3)
        assert len(answer.choices[0].text.split()) == 3
        [prefill_body], [decode_body] = list(prefill.engine.received), list(decode.engine.received)
        transfer_id = prefill_body["kv_transfer_params"]["transfer_id"]
        assert transfer_id.startswith("xfer-")
        assert decode_body["kv_transfer_params"] == {
            "do_remote_decode": False, "do_remote_prefill": True, "transfer_id": transfer_id,
            "remote_bootstrap_addr": f"http://127.0.0.1:{bootstrap}",
            "remote_engine_id": "prefill-vllm"}  # from the bootstrap server's /query
    finally:
        await gateway.close()
        for handle in (prefill, decode):
            await handle.close()


@pytest.mark.parametrize(("instances", "protocol", "skip", "message"), [
    ([("d", "decode")], "vllm", 0, "no prefill instance"),
    ([("p", "prefill")], "vllm", 0, "no decode instance"),
    ([("p", "prefill"), ("d", "decode")], "sglang", 10, "needs pd_protocol vllm"),
])
def test_invalid_fleets_stop_start_up(instances, protocol, skip, message):
    with pytest.raises(ValueError, match=message):
        Settings(pd_protocol=protocol, pd_skip_prefill_below_tokens=skip,
                 instances=[instance(i, "http://127.0.0.1:1", role) for i, role in instances])


def test_a_gateway_refuses_prefill_and_decode_instances_without_a_protocol(tmp_path, capsys):
    from kvgate.cli import main

    config = tmp_path / "fleet.yaml"
    config.write_text("instances:\n"
                      "  - {id: p, url: 'http://127.0.0.1:1', model: m, role: prefill}\n"
                      "  - {id: d, url: 'http://127.0.0.1:2', model: m, role: decode}\n")
    assert main(["serve", "--config", str(config), "--check-config"]) == 2
    assert "pd_protocol is not set" in capsys.readouterr().err
    assert main(["serve", "--config", str(config), "--pd-protocol", "vllm", "--check-config"]) == 0
    with pytest.raises(ValueError, match="pd_protocol is not set"):
        from kvgate.gateway.http.app import build_app

        build_app(Settings.model_validate({"instances": [instance("p", "http://127.0.0.1:1", "prefill"),
                                                         instance("d", "http://127.0.0.1:2", "decode")]}),
                  tokenizer=tokenizer())


def test_bootstrap_fields_belong_to_prefill_instances():
    with pytest.raises(ValueError, match="prefill instances only"):
        InstanceConfig(id="d", url="http://127.0.0.1:1", model=MODEL, role="decode", bootstrap_port=9) and Settings(
            pd_protocol="vllm", instances=[instance("p", "http://127.0.0.1:1", "prefill"),
                                           instance("d", "http://127.0.0.1:2", "decode", 9)])


async def test_sglang_engines_export_sglang_metric_names():
    handle = await engine("decode", "sglang")
    try:
        async with aiohttp.ClientSession() as session, session.get(handle.url + "/metrics") as answer:
            text = await answer.text()
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"):
            assert f"\n{name}{{" in text
        assert "vllm:num_requests_running" not in text
    finally:
        await handle.close()


async def test_the_demo_runs_a_disaggregated_fleet():
    from kvgate.config.settings import PDProtocol
    from kvgate.demo.fleet import FleetSpec, running_fleet

    spec = FleetSpec(4, MockEngineConfig(time_scale=0.02), pd_protocol=PDProtocol.SGLANG)
    assert [spec.role(i).value for i in range(4)] == ["prefill", "prefill", "decode", "decode"]
    async with running_fleet(spec, "cache_aware", tokenizer()) as url:
        answer = await client(url).completions.create(model=MODEL, prompt=[1, 2, 3, 4, 5], max_tokens=3)
        assert len(answer.choices[0].text.split()) == 3


async def test_a_mooncake_prefill_whose_bootstrap_server_is_silent_is_replaced():
    bootstrap = free_port()
    prefill, decode = await engine("prefill", "vllm", bootstrap), await engine("decode", "vllm")
    # "a-silent" is a live engine, but nothing answers on the bootstrap port it is configured with.
    silent = await engine("prefill", "vllm")
    instances = [instance("a-silent", silent.url, "prefill", free_port()), instance("p-live", prefill.url, "prefill",
                 bootstrap), instance("d0", decode.url, "decode")]
    gateway = await start_gateway(settings("vllm", instances, dispatch_policy="round_robin"), tokenizer=tokenizer())
    try:
        answer = await client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
        assert len(answer.choices[0].text.split()) == 2
        assert list(silent.engine.received) == []  # refused before anything was sent to it
        assert counter_value(gateway, "kvgate_forward_retries_total", instance="a-silent") == 1
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()
        for handle in (prefill, decode, silent):
            await handle.close()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_client_hang_up_during_the_prefill_cancels_both(protocol):
    bootstrap = free_port() if protocol == "sglang" else None
    # A slow modelled GPU (500x): the prefill would take ~20 s, far longer than the waits below, so
    # the engines can only be free again because the hang-up cancelled the requests.
    slow = MockEngineConfig(time_scale=500.0, pd=PDRole("prefill", protocol, 1e6, bootstrap))
    prefill = await start_mock_engine(slow, tokenizer=TokenizerService(tokenizer()))
    decode = await engine("decode", protocol)
    instances = [instance("p0", prefill.url, "prefill", bootstrap), instance("d0", decode.url, "decode")]
    gateway = await start_gateway(settings(protocol, instances), tokenizer=tokenizer())
    try:
        impatient = openai_client(gateway.url, timeout=0.5)
        with pytest.raises(openai.APITimeoutError):
            await impatient.completions.create(model=MODEL, prompt=PROMPT * 4, max_tokens=5, stream=True)
        assert len(prefill.engine.received) == 1  # the prefill was under way
        await wait_until(lambda: prefill.engine.loop.num_open_requests == 0)
        await wait_until(lambda: decode.engine.loop.num_open_requests == 0)
        await assert_nothing_in_flight(gateway)
        assert len(gateway.app[GATEWAY].decode_ledger) == 0
    finally:
        await gateway.close()
        for handle in (prefill, decode):
            await handle.close()


@pytest.mark.parametrize(("flags", "message"), [
    (["--role", "decode"], "needs --pd-protocol"),
    (["--role", "decode", "--pd-protocol", "vllm", "--bootstrap-port", "9000"], "belongs to a prefill engine"),
    (["--pd-protocol", "sglang"], "need --role prefill or decode"),
])
def test_mock_engine_pd_flags_are_checked(flags, message, capsys):
    from kvgate.cli import main

    assert main(["mock-engine", "--port", "0", *flags, "--check"]) == 2
    assert message in capsys.readouterr().err


async def test_batched_prompts_and_n_are_refused_for_a_disaggregated_model(fleet):
    _, prefill, decode, gateway, _ = fleet
    c = client(gateway.url)
    with pytest.raises(openai.BadRequestError, match="one prompt per request and n=1"):
        await c.completions.create(model=MODEL, prompt=["first", "second"], max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="one prompt per request and n=1"):
        await c.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=2)
    assert list(prefill.engine.received) == list(decode.engine.received) == []
    await assert_nothing_in_flight(gateway)


async def test_the_prefill_answer_feeds_the_hit_accounting():
    """vLLM's prefill answer reports the cached tokens the prefill instance found: the gateway compares
    them with the prefix hit it predicted from the store (here the demo's embedded index)."""
    from kvgate.config.settings import PDProtocol
    from kvgate.demo.fleet import FleetSpec, running_fleet

    spec = FleetSpec(4, MockEngineConfig(time_scale=0.02), pd_protocol=PDProtocol.VLLM)
    prompt = list(range(1000, 2400))  # long enough for cache-aware routing to ask the store
    async with running_fleet(spec, "cache_aware", tokenizer()) as url:
        for _ in range(2):  # the second time, the prefill instance that computed it holds it
            await client(url).completions.create(model=MODEL, prompt=prompt, max_tokens=2)
        async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as answer:
            text = await answer.text()
    reported = predicted = 0.0
    for line in text.splitlines():
        if line.startswith("kvgate_reported_cached_tokens_total{"):
            assert 'instance="engine-0"' in line or 'instance="engine-1"' in line  # prefill instances only
            reported += float(line.rsplit(" ", 1)[1])
        if line.startswith("kvgate_predicted_cached_tokens_total{"):
            predicted += float(line.rsplit(" ", 1)[1])
    assert reported == predicted == len(prompt) // 256 * 256


async def test_a_502_hides_the_prefill_engines_body_from_the_client_and_logs_it(caplog):
    leaky = await ScriptedUpstream("leaky", Script(status=500)).start()
    decode = await engine("decode", "vllm")
    gateway = await start_gateway(
        settings("vllm", [instance("p-leaky", leaky.url, "prefill"), instance("d0", decode.url, "decode")]),
        tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.WARNING, logger="kvgate.gateway.http.relay"):
            async with aiohttp.ClientSession() as session, session.post(
                    gateway.url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                    headers={"X-Request-Id": "pd-req-7"}) as response:
                status, body = response.status, await response.json()
        assert status == 502 and body["error"]["code"] == "upstream_unavailable"
        assert "leaky says 500" not in body["error"]["message"] and "pd-req-7" in body["error"]["message"]
        assert any("pd-req-7" in r.getMessage() and "leaky says 500" in r.getMessage() for r in caplog.records)
        assert not decode.engine.received  # the hand-off never reached the decode engine
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()
        await leaky.close()
        await decode.close()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_the_prefill_answer_calibrates_the_ttft_model_of_the_prefill_instance(protocol):
    bootstrap = free_port() if protocol == "sglang" else None
    prefill, decode = await engine("prefill", protocol, bootstrap), await engine("decode", protocol)
    gateway = await start_gateway(
        settings(protocol, [instance("p0", prefill.url, "prefill", bootstrap), instance("d0", decode.url, "decode")],
                 dispatch_policy="conductor", cache_aware_scheduling_min_tokens=0),
        tokenizer=tokenizer())
    try:
        await client(gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        # The conductor predicted the prefill instance's TTFT; its answer's arrival measured it.
        await wait_until(lambda: counter_value(gateway, "kvgate_ttft_prediction_error_seconds_count") == 1)
        assert counter_value(gateway, "kvgate_ttft_calibration_observations", instance="p0") == 1
        assert not counter_value(gateway, "kvgate_ttft_calibration_observations", instance="d0")
        await assert_nothing_in_flight(gateway)
    finally:
        await gateway.close()
        for handle in (prefill, decode):
            await handle.close()
