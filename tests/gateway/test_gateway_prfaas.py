"""Prefill-as-a-Service through the gateway: a local PD cluster (one prefill, one decode mock engine)
and a remote cluster of prefill engines behind a modelled link, all publishing to one embedded index,
driven by the official openai client. The cluster rule is scheduler/prfaas.py; here it runs on real
prefix hits, real queues from the account, and records the KV that really crossed."""

from __future__ import annotations

import contextlib

import aiohttp
import openai
import pytest

from kvgate.config.settings import InstanceConfig, PDProtocol
from kvgate.demo.fleet import FleetSpec, PrfaasSpec, free_port, gateway_settings, start_engines
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.mock_engine.server import MockEngineConfig
from tests.gateway_helpers import (
    assert_hang_up_released,
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    read_events,
    tokenizer,
)
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MODEL = MockEngineConfig().model
KV_BYTES_PER_TOKEN = 1000


def prompt(start: int, length: int) -> list[int]:
    return list(range(start, start + length))


def prfaas_settings(**overrides) -> dict:
    return {"prfaas_cluster": "remote", "prfaas_egress_gbps": 10.0, "prfaas_kv_bytes_per_token": KV_BYTES_PER_TOKEN,
            "prfaas_threshold_tokens": 512, "prfaas_threshold_min_tokens": 256,
            "prfaas_threshold_max_tokens": 4096, **overrides}


@contextlib.asynccontextmanager
async def prfaas_fleet(protocol: str = "vllm", remote_engines: int = 1, dead_remote: bool = False, **gateway):
    """engine-0 local prefill, engine-1 local decode, engine-2.. remote prefill; yields (engines, gateway)."""
    spec = FleetSpec(2, MockEngineConfig(time_scale=0.02), pd_protocol=PDProtocol(protocol),
                     prfaas=PrfaasSpec(remote_engines, 1e6, prfaas_settings(**gateway)))
    index = EmbeddedKVSIndex()
    engines = await start_engines(spec, index)
    # Health checks stay out of the way: a dead instance is found by the request that meets it.
    settings = gateway_settings(spec, "cache_aware", engines).model_copy(
        update={"health_check_interval_s": 60.0, "stats_poll_interval_s": 60.0})
    if dead_remote:  # first in configuration order: the policy's ties pick it first
        dead = InstanceConfig(id="a-dead", url=closed_port_url(), model=MODEL, role="prefill", cluster="remote",
                              kvs_endpoints=("127.0.0.99",),
                              bootstrap_port=free_port() if protocol == "sglang" else None)
        settings = settings.model_copy(update={"instances": (dead, *settings.instances)})
    handle = await start_gateway(settings, kvs_index=index, tokenizer=tokenizer())
    try:
        yield engines, handle
    finally:
        await handle.close()
        for engine in engines:
            await engine.close()


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


async def explain(url: str, prompt_ids: list[int]) -> dict:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/debug/schedule", json={"model": MODEL, "prompt": prompt_ids, "max_tokens": 2}) as answer:
        assert answer.status == 200
        return await answer.json()


async def flushed(engines) -> None:
    for engine in engines:
        await engine.engine.publication.flushed()


async def test_incremental_length_decides_and_a_locally_cached_prefix_keeps_a_long_prompt_local():
    async with prfaas_fleet(prfaas_bandwidth_mode="scarce", prfaas_threshold_tokens=1024) as (engines, gateway):
        local_prefill, decode, remote = engines
        c = client(gateway.url)
        short = prompt(1000, 1000)
        shown = await explain(gateway.url, short)
        assert shown["prfaas"]["cluster"] == "local" and shown["prfaas"]["incremental_tokens"] == 1000
        assert shown["prefill"]["ranking"] == ["engine-0"]  # only the local cluster's prefill instances
        assert "<= threshold 1024" in shown["prfaas"]["reason"]
        await c.completions.create(model=MODEL, prompt=short, max_tokens=2)
        assert len(local_prefill.engine.received) == 1 and list(remote.engine.received) == []
        assert counter_value(gateway, "kvgate_prfaas_egress_bytes_total") == 0  # nothing crossed

        long = prompt(5000, 1500)
        shown = await explain(gateway.url, long)
        assert shown["prfaas"]["offloaded"] is True and shown["prfaas"]["cluster"] == "remote"
        assert shown["prefill"]["ranking"] == ["engine-2"] and shown["decode"]["ranking"] == ["engine-1"]
        assert shown["prfaas"]["egress_bytes"] == 1500 * KV_BYTES_PER_TOKEN
        answer = await c.completions.create(model=MODEL, prompt=long, max_tokens=3)
        assert len(answer.choices[0].text.split()) == 3
        assert len(remote.engine.received) == 1 and len(decode.engine.received) == 2
        assert counter_value(gateway, "kvgate_prfaas_egress_bytes_total") == 1500 * KV_BYTES_PER_TOKEN
        assert counter_value(gateway, "kvgate_prfaas_decisions_total", cluster="remote") == 1

        # The local prefill instance holds the first prompt's full blocks (768 tokens): that prompt
        # with 500 more tokens is as long as `long`, but only 732 of it is uncached locally: local.
        await flushed(engines)
        follow_up = short + prompt(90000, 500)
        shown = await explain(gateway.url, follow_up)
        assert shown["prfaas"]["cluster"] == "local" and shown["prfaas"]["prefix_tokens"] == 768
        assert shown["prfaas"]["incremental_tokens"] == 732
        await c.completions.create(model=MODEL, prompt=follow_up, max_tokens=2)
        assert len(local_prefill.engine.received) == 2 and len(remote.engine.received) == 1
        assert counter_value(gateway, "kvgate_prfaas_decisions_total", cluster="local") == 2
        await assert_nothing_in_flight(gateway)
        assert len(gateway.app[GATEWAY].decode_ledger) == 0


async def warm_remote_only(remote, prompt_ids: list[int]) -> None:
    """The remote prefill engine computes a prompt no decode engine ever pulls (its KV stays there)."""
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False}}
    async with aiohttp.ClientSession() as session, session.post(remote.url + "/v1/completions", json=body) as answer:
        assert answer.status == 200


@pytest.mark.parametrize("mode", ["scarce", "abundant"])
async def test_a_prefix_cached_only_remotely_counts_only_when_the_link_is_abundant(mode):
    async with prfaas_fleet(prfaas_bandwidth_mode=mode) as (engines, gateway):
        local_prefill, _, remote = engines
        cached = prompt(7000, 1280)
        await warm_remote_only(remote, cached)
        await flushed(engines)
        request = cached + prompt(60000, 200)  # 1480 tokens, 1280 of them cached in the remote cluster
        shown = (await explain(gateway.url, request))["prfaas"]
        assert shown["mode"] == mode
        if mode == "scarce":
            # Judged on the local prefix alone: 1480 uncached locally > 512, prefilled remotely on its prefix.
            assert shown["offloaded"] is True and shown["incremental_tokens"] == 200
            assert shown["prefix_cluster"] == "remote" and shown["shipped_prefix_tokens"] == 0
            assert shown["egress_bytes"] == 1480 * KV_BYTES_PER_TOKEN
        else:
            # The longer prefix counts wherever it lies: 200 left, prefilled locally, the prefix shipped.
            assert shown["offloaded"] is False and shown["incremental_tokens"] == 200
            assert shown["shipped_prefix_tokens"] == 1280
            assert shown["egress_bytes"] == 1280 * KV_BYTES_PER_TOKEN
        await client(gateway.url).completions.create(model=MODEL, prompt=request, max_tokens=2)
        assert len(local_prefill.engine.received) == (0 if mode == "scarce" else 1)
        assert counter_value(gateway, "kvgate_prfaas_egress_bytes_total") == shown["egress_bytes"]
        await assert_nothing_in_flight(gateway)


async def metric(url: str, name: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as answer:
        for line in (await answer.text()).splitlines():
            if line.startswith(name + " "):
                return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


async def test_a_saturated_link_raises_the_threshold_within_its_bounds():
    # 1400 tokens of 1000 bytes over a 10 s window is 1.12 Mbit/s: a 1 Mbit/s link is saturated by one.
    async with prfaas_fleet(prfaas_egress_gbps=0.001, prfaas_adapt_interval_s=0.001,
                            prfaas_threshold_max_tokens=700) as (engines, gateway):
        c = client(gateway.url)
        await c.completions.create(model=MODEL, prompt=prompt(5000, 1400), max_tokens=2)
        assert await metric(gateway.url, "kvgate_prfaas_link_utilisation") == pytest.approx(1.12)
        assert await metric(gateway.url, "kvgate_prfaas_egress_gbps") == pytest.approx(0.00112)
        assert await metric(gateway.url, "kvgate_prfaas_offload_fraction") == 1.0
        for n in range(2):  # each decision adapts first: 512 -> 640 -> 700 (the bound)
            await c.completions.create(model=MODEL, prompt=prompt(20000 + 2000 * n, 300), max_tokens=2)
        link = (await explain(gateway.url, prompt(1, 300)))["prfaas"]["link"]
        assert link["threshold_tokens"] == 700 and "link 112% >= 90%" in link["threshold_last_change"]
        assert await metric(gateway.url, "kvgate_prfaas_threshold_tokens") == 700
        assert await metric(gateway.url, "kvgate_prfaas_offload_fraction") == pytest.approx(1 / 3)
        await assert_nothing_in_flight(gateway)


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_dead_remote_prefill_is_retried_in_its_cluster_and_every_account_returns_to_zero(protocol):
    async with prfaas_fleet(protocol, remote_engines=1, dead_remote=True) as (engines, gateway):
        long = prompt(5000, 1400)
        answer = await client(gateway.url).completions.create(model=MODEL, prompt=long, max_tokens=3)
        assert len(answer.choices[0].text.split()) == 3
        retries = {i: counter_value(gateway, "kvgate_forward_retries_total", instance=i)
                   for i in ("a-dead", "engine-0", "engine-1", "engine-2")}
        assert retries == {"a-dead": 1, "engine-0": 0, "engine-1": 0, "engine-2": 0}
        # One crossing recorded, by the try that reached the decode instance.
        assert counter_value(gateway, "kvgate_prfaas_egress_bytes_total") == 1400 * KV_BYTES_PER_TOKEN
        await assert_nothing_in_flight(gateway)
        assert len(gateway.app[GATEWAY].decode_ledger) == 0


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_client_hang_up_on_an_offloaded_stream_releases_everything(protocol):
    async with prfaas_fleet(protocol) as (engines, gateway):
        _, decode, remote = engines
        stream = await client(gateway.url).completions.create(model=MODEL, prompt=prompt(5000, 1400),
                                                              max_tokens=3000, stream=True)
        await read_events(stream, 3)
        assert gateway.app[GATEWAY].decode_ledger.tokens == {"engine-1": 3000}
        await stream.close()
        await assert_hang_up_released(gateway, decode.engine, remote.engine)


async def test_the_only_remote_prefill_dead_answers_502_and_leaves_nothing_behind():
    async with prfaas_fleet(remote_engines=1, dead_remote=True) as (engines, gateway):
        # engine-2 goes away too: the remote cluster has no live prefill instance left.
        await engines[2].close()
        with pytest.raises(openai.APIStatusError) as raised:
            await client(gateway.url).completions.create(model=MODEL, prompt=prompt(5000, 1400), max_tokens=2)
        assert raised.value.status_code == 502
        assert counter_value(gateway, "kvgate_prfaas_egress_bytes_total") == 0
        await assert_nothing_in_flight(gateway)
        assert len(gateway.app[GATEWAY].decode_ledger) == 0


def test_prfaas_instances_must_prefill():
    with pytest.raises(ValueError, match="in the PrfaaS cluster 'remote' but their role is not prefill"):
        from kvgate.config.settings import Settings

        Settings(pd_protocol="vllm", **prfaas_settings(), instances=[
            InstanceConfig(id="p", url="http://127.0.0.1:1", model=MODEL, role="prefill"),
            InstanceConfig(id="d", url="http://127.0.0.1:2", model=MODEL, role="decode", cluster="remote")])




@pytest.mark.parametrize("flags", [
    ["--role", "decode", "--pd-protocol", "vllm", "--egress-tokens-per-s", "1000"],
    ["--role", "prefill", "--pd-protocol", "vllm", "--egress-tokens-per-s", "0"],
    ["--egress-tokens-per-s", "1000"],
])
def test_the_mock_egress_link_belongs_to_a_prefill_engine(flags, capsys):
    from kvgate.cli import main

    assert main(["mock-engine", "--port", "0", *flags, "--check"]) == 2
    assert "--egress-tokens-per-s" in capsys.readouterr().err
