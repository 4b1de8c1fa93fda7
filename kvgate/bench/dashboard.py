"""The Grafana dashboard (deploy/grafana/kvgate.json) against a live fleet.

Its panels and the metric names their PromQL reads, and a small fleet of mock engines behind two
gateways driven so that every series the dashboard reads exists: a cache-aware gateway with a KV
store, the engines' KV events, client API keys and account sync (one instance dead, to show retries
and an ejection), and a prefill/decode gateway with a Prefill-as-a-Service cluster. The deployment
tests check the dashboard's names against it; deploy/grafana/render_png.py plots the panels from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.config.settings import InstanceConfig, PDProtocol, Settings
from kvgate.demo.fleet import FleetSpec, KVEventsSpec, PrfaasSpec, free_port, gateway_settings, start_engines
from kvgate.gateway.http.server import GatewayHandle, start_gateway
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.mock_engine.server import MockEngineConfig, MockEngineHandle

DASHBOARD_PATH = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "kvgate.json"
API_KEY = "dashboard-0123456789abcdef"
MODEL = MockEngineConfig().model
_GUESSER_ADDRESS = "127.0.0.3"  # a client sending wrong keys
_METRIC = re.compile(r"\bkvgate_[a-z0-9_]+\b")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')


@dataclasses.dataclass(frozen=True)
class Target:
    legend: str
    expr: str


@dataclasses.dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    targets: tuple[Target, ...]


def load_panels(path: Path = DASHBOARD_PATH) -> list[Panel]:
    """The dashboard's graph panels in order (rows left out)."""
    dashboard = json.loads(path.read_text())
    return [
        Panel(p["title"], p["fieldConfig"]["defaults"].get("unit", ""),
              tuple(Target(t.get("legendFormat", ""), t["expr"]) for t in p["targets"]))
        for p in dashboard["panels"] if p["type"] != "row"
    ]


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression reads (as exported: counters with _total, histograms'
    _bucket); names inside label-value strings are not reads."""
    return set(_METRIC.findall(_STRING.sub('""', expr)))


def grouping_labels(expr: str) -> set[str]:
    """Labels named in `by (...)` clauses (le excepted: every histogram has it)."""
    labels = {label.strip() for group in re.findall(r"\bby\s*\(([^)]*)\)", expr) for label in group.split(",")}
    return labels - {"le", ""}


@dataclasses.dataclass
class DashboardFleet:
    """Gateways (URLs in `cache_aware` and `pd`) and their engines; the cache-aware gateways' instance
    `a-dead` never answers."""

    cache_aware: list[GatewayHandle]
    pd: GatewayHandle
    engines: list[MockEngineHandle]

    @property
    def gateways(self) -> list[GatewayHandle]:
        return [*self.cache_aware, self.pd]


def _cache_aware_settings(spec: FleetSpec, engines: list[MockEngineHandle], events: KVEventsSpec,
                          keys_file: str, account_sync: str) -> Settings:
    settings = gateway_settings(spec, "cache_aware", engines)
    instances = [i.model_copy(update={
        "kv_events_endpoint": events.endpoint(n), "kv_events_replay_endpoint": events.replay_endpoint(n)})
        for n, i in enumerate(settings.instances)]
    # First in id order: ties pick it, so requests meet it, retry and eject it.
    dead = InstanceConfig(id="a-dead", url=f"http://127.0.0.1:{free_port()}", model=MODEL,
                          kvs_endpoints=("127.0.0.99",), kv_events_endpoint=f"tcp://127.0.0.1:{free_port()}")
    return settings.model_copy(update={
        "instances": (dead, *instances), "cache_aware_scheduling_min_tokens": 256,
        # Health checks alone never eject (the dead instance stays in until requests meet it): the
        # outlier detector does, after two failed requests, so retries and the ejection are seen.
        "health_check_interval_s": 1.0, "health_check_failures_to_eject": 1000,
        "stats_poll_interval_s": 1.0, "outlier_consecutive_failures": 2,
        "api_keys_file": keys_file, "debug_routes": "public", "auth_failure_budget": 1,
        "account_sync": account_sync,
    })


@contextlib.asynccontextmanager
async def dashboard_fleet(workdir: Path, account_sync: str, replicas: int = 1,
                          time_scale: float = 0.02, tokenizer: Any = None) -> AsyncIterator[DashboardFleet]:
    """Three cache-aware engines with KV events behind `replicas` gateways syncing their accounts
    through the Redis at `account_sync`, and a PD fleet (local prefill + decode, one remote prefill
    engine) behind its own gateway."""
    keys_file = workdir / "api-keys"
    keys_file.write_text(f"dashboard:{API_KEY}\n")
    engine = MockEngineConfig(time_scale=time_scale)
    events = KVEventsSpec(str(workdir))
    spec = FleetSpec(3, engine, kv_events=events)
    pd_spec = FleetSpec(2, engine, pd_protocol=PDProtocol.VLLM, prfaas=PrfaasSpec(1, 2e5, {
        "prfaas_cluster": "remote", "prfaas_egress_gbps": 10.0, "prfaas_kv_bytes_per_token": 131072,
        "prfaas_threshold_tokens": 1024, "prfaas_threshold_min_tokens": 512, "prfaas_threshold_max_tokens": 8192}))
    index, pd_index = EmbeddedKVSIndex(), EmbeddedKVSIndex()
    engines: list[MockEngineHandle] = []
    gateways: list[GatewayHandle] = []
    try:
        engines += await start_engines(spec, index)
        settings = _cache_aware_settings(spec, engines, events, str(keys_file), account_sync)
        for _ in range(replicas):
            gateways.append(await start_gateway(settings, kvs_index=index, tokenizer=tokenizer))
        pd_engines = await start_engines(pd_spec, pd_index)
        engines += pd_engines
        pd_settings = gateway_settings(pd_spec, "cache_aware", pd_engines).model_copy(
            update={"health_check_interval_s": 1.0, "stats_poll_interval_s": 1.0})
        pd = await start_gateway(pd_settings, kvs_index=pd_index, tokenizer=tokenizer)
        gateways.append(pd)
        yield DashboardFleet(gateways[:-1], pd, engines)
    finally:
        for gateway in gateways:
            await gateway.close()
        await asyncio.gather(*(engine.close() for engine in engines))


def _prompt(conversation: int, turn: int, length: int) -> list[int]:
    """Token ids: a conversation's prefix grows by turn, so later turns hit what earlier ones cached."""
    base = 1000 + conversation * 100_000
    return list(range(base, base + length + turn * 300))


async def exercise(fleet: DashboardFleet, round_number: int) -> None:
    """One round of traffic: conversations on the cache-aware gateways (whole and streamed), a new
    one (the dead instance's retries and ejection), a wrong key twice (401, then 429 from the
    failed-authentication budget), a prefix-cache reset on one engine every fifth round (a KV
    events reset), and short and long prompts through the PD gateway (local and remote prefill)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with aiohttp.ClientSession() as session:

        async def post(url: str, body: dict, auth: dict | None = headers) -> None:
            async with session.post(url + "/v1/completions", json=body, headers=auth) as answer:
                await answer.read()

        calls = []
        for conversation in range(4):
            gateway = fleet.cache_aware[conversation % len(fleet.cache_aware)]
            body = {"model": MODEL, "prompt": _prompt(conversation, round_number % 6, 600 + 200 * conversation),
                    "max_tokens": 8, "stream": conversation % 2 == 0}
            calls.append(post(gateway.url, body))
        # A new conversation: nothing cached anywhere, so the tie goes to the dead instance until it is out.
        calls.append(post(fleet.cache_aware[0].url, {"model": MODEL, "prompt": _prompt(100 + round_number, 0, 600),
                                                     "max_tokens": 8}))
        # A short prompt the local prefill engine caches, and a new long one (remote prefill).
        for conversation, length in ((10, 300), (20 + round_number, 3000)):
            calls.append(post(fleet.pd.url, {"model": MODEL, "max_tokens": 4,
                                             "prompt": _prompt(conversation, 0, length)}, auth=None))
        await asyncio.gather(*calls)
        # From an address of its own: a throttled address is refused whatever key it sends.
        guesser = aiohttp.TCPConnector(local_addr=(_GUESSER_ADDRESS, 0))
        async with aiohttp.ClientSession(connector=guesser) as guessing:
            for _ in range(2):
                async with guessing.post(fleet.cache_aware[0].url + "/v1/completions", json={"model": MODEL},
                                         headers={"Authorization": "Bearer wrong"}) as answer:
                    await answer.read()
        if round_number % 5 == 4:
            async with session.post(fleet.engines[0].url + "/reset_prefix_cache") as answer:
                await answer.read()
