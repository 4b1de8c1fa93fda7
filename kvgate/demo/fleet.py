"""Mock engines and a gateway in the running event loop, wired to one KV store.

The store is the embedded index (shared in-process by engines and gateway) or, with a Mooncake
master, the real store: each engine publishes from its own loopback IP (127.0.0.2, .3, ...) and
the gateway maps those IPs back to instances, exactly as it would for separate hosts.
With `kv_events`, every engine also publishes its prefix cache's changes as vLLM's KV events and
the gateway follows them (beside the store, or alone with `store=False`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from kvgate.config.settings import (
    LOCAL_CLUSTER,
    InstanceConfig,
    InstanceRole,
    KVSBackendName,
    PDProtocol,
    Settings,
)
from kvgate.gateway.http.server import start_gateway
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.kvs_client.launch import MooncakeMasterProcess
from kvgate.mock_engine.kv_event_wire import EventEncoding, HashFormat
from kvgate.mock_engine.kv_events import DEFAULT_TOPIC, KVEventsOptions
from kvgate.mock_engine.pd import PDRole
from kvgate.mock_engine.publishers import PublisherOptions, open_publisher
from kvgate.mock_engine.server import MockEngineConfig, MockEngineHandle, start_mock_engine


@dataclass(frozen=True)
class PrfaasSpec:
    """A remote Prefill-as-a-Service cluster of prefill engines, after the local ones (docs/PRFAAS.md)."""

    num_engines: int
    # The link their KV crosses to the local decode engines, in prompt tokens per modelled second;
    # each engine's egress gets an equal share of it, on which its transfers queue.
    link_tokens_per_s: float
    # The gateway's prfaas_* settings (its cluster name, threshold, link in Gbit/s, KV size).
    gateway: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def cluster(self) -> str:
        return self.gateway.get("prfaas_cluster", "prfaas")


@dataclass(frozen=True)
class KVEventsSpec:
    """Every engine publishes KV events as a vLLM does, with a replay socket beside. The engine binds
    both (vLLM's rule for `*` and ipc); a subscriber connects to `endpoint(i)` and `replay_endpoint(i)`.

    With `directory`: ipc sockets in it. Without: TCP ports, bound as `tcp://*:PORT` as kvgate's real
    vLLM engines are (kvgate/engines/vllm.py), each engine's pair picked when first asked for."""

    directory: str | None = None
    encoding: EventEncoding = "map"
    hash_format: HashFormat = "int"
    topic: str = DEFAULT_TOPIC
    _ports: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def endpoint(self, index: int) -> str:
        """Where a subscriber connects for engine `index`'s events."""
        if self.directory is not None:
            return f"ipc://{self.directory}/engine-{index}.events"
        return f"tcp://127.0.0.1:{self._port_pair(index)[0]}"

    def replay_endpoint(self, index: int) -> str:
        if self.directory is not None:
            return f"ipc://{self.directory}/engine-{index}.replay"
        return f"tcp://127.0.0.1:{self._port_pair(index)[1]}"

    def options(self, index: int) -> KVEventsOptions:
        """What engine `index` binds."""
        if self.directory is not None:
            events, replay = self.endpoint(index), self.replay_endpoint(index)
        else:
            events_port, replay_port = self._port_pair(index)
            events, replay = f"tcp://*:{events_port}", f"tcp://*:{replay_port}"
        return KVEventsOptions(events, replay, self.topic, self.encoding, self.hash_format)

    def _port_pair(self, index: int) -> tuple[int, int]:
        if index not in self._ports:
            self._ports[index] = (free_port(), free_port())
        return self._ports[index]


@dataclass(frozen=True)
class FleetSpec:
    num_engines: int
    engine: MockEngineConfig
    mooncake: MooncakeMasterProcess | None = None
    # Prefill/decode disaggregation: the first half of the engines prefill, the rest decode.
    pd_protocol: PDProtocol | None = None
    # With pd_protocol: a remote prefill cluster, engines num_engines and up.
    prfaas: PrfaasSpec | None = None
    # Engines also publish KV events (engine i on kv_events.endpoint(i)) and the gateway follows
    # them; None: they do not.
    kv_events: KVEventsSpec | None = None
    # False: no store at all (needs kv_events), the gateway routes on the events alone.
    store: bool = True

    def __post_init__(self) -> None:
        if not self.store and (self.kv_events is None or self.mooncake is not None):
            raise ValueError("a fleet without a store routes on KV events: give kv_events, not mooncake")

    @property
    def total_engines(self) -> int:
        return self.num_engines + (self.prfaas.num_engines if self.prfaas else 0)

    def cluster(self, index: int) -> str:
        return self.prfaas.cluster if self.prfaas and index >= self.num_engines else LOCAL_CLUSTER

    def engine_ip(self, index: int) -> str:
        """The loopback IP engine `index` holds its blocks at (its endpoint in the store)."""
        return f"127.0.0.{index + 2}"

    def role(self, index: int) -> InstanceRole:
        if self.pd_protocol is None:
            return InstanceRole.NEUTRAL
        if index >= self.num_engines:
            return InstanceRole.PREFILL
        return InstanceRole.PREFILL if index < max(1, self.num_engines // 2) else InstanceRole.DECODE

    def engine_config(self, index: int) -> MockEngineConfig:
        events = self.kv_events.options(index) if self.kv_events is not None else None
        engine = dataclasses.replace(self.engine, kv_events=events)
        role = self.role(index)
        if role == InstanceRole.NEUTRAL:
            return engine
        assert self.pd_protocol is not None
        # A prefill engine's bootstrap server needs a port of its own (SGLang always, vLLM never here).
        bootstrap = free_port() if role == InstanceRole.PREFILL and self.pd_protocol == PDProtocol.SGLANG else None
        egress = None
        if self.prfaas is not None and index >= self.num_engines:
            egress = self.prfaas.link_tokens_per_s / self.prfaas.num_engines
        return dataclasses.replace(engine, pd=PDRole(role.value, self.pd_protocol.value, bootstrap_port=bootstrap,
                                                          egress_tokens_per_s=egress))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def gateway_settings(spec: FleetSpec, policy: str, engines: list[MockEngineHandle]) -> Settings:
    """The engines' own hashing settings, plus the routing policy, instances and store address."""
    instances = tuple(
        InstanceConfig(
            id=f"engine-{i}", url=engine.url, model=spec.engine.model, kvs_endpoints=(spec.engine_ip(i),),
            role=spec.role(i), cluster=spec.cluster(i),
            bootstrap_port=engine.engine.config.pd.bootstrap_port if engine.engine.config.pd else None,
            **(
                {"kv_events_endpoint": spec.kv_events.endpoint(i),
                 "kv_events_replay_endpoint": spec.kv_events.replay_endpoint(i)}
                if spec.kv_events is not None
                else {}
            ),
        )
        for i, engine in enumerate(engines)
    )
    values: dict[str, Any] = {
        **spec.engine.settings.model_dump(),
        "host": "127.0.0.1",
        "port": 0,
        "dispatch_policy": policy,
        "instances": instances,
        "kvs_backend": _kvs_backend(spec),
        "pd_protocol": spec.pd_protocol,
        **(spec.prfaas.gateway if spec.prfaas else {}),
    }
    if spec.mooncake is not None:
        values["kvs_metadata_service_http_server_host"] = spec.mooncake.host
        values["kvs_metadata_service_http_server_port"] = spec.mooncake.admin_port
    return Settings.model_validate(values)


def _kvs_backend(spec: FleetSpec) -> KVSBackendName:
    if not spec.store:
        return KVSBackendName.KV_EVENTS
    return KVSBackendName.MOONCAKE if spec.mooncake else KVSBackendName.EMBEDDED


async def _start_engine(spec: FleetSpec, index: int, embedded: EmbeddedKVSIndex | None) -> MockEngineHandle:
    master = spec.mooncake
    options = PublisherOptions(
        backend="none" if not spec.store else "mooncake" if master else "embedded",
        settings=spec.engine.settings,
        local_ip=spec.engine_ip(index),
        **(
            {"mooncake_master": master.rpc_address, "mooncake_metadata_url": master.metadata_url}
            if master
            else {}
        ),
    )
    publisher = await open_publisher(options, embedded)
    try:
        return await start_mock_engine(spec.engine_config(index), publisher=publisher, name=f"engine-{index}")
    except BaseException:
        if publisher is not None:
            await publisher.close()
        raise


@contextlib.asynccontextmanager
async def running_fleet(spec: FleetSpec, policy: str, tokenizer: Any) -> AsyncIterator[str]:
    """Fresh engines (empty caches) and a gateway routing with `policy`; yields the gateway's URL.

    `tokenizer` is a loaded Hugging Face tokenizer handed to the gateway (loaded once per demo).
    """
    embedded = EmbeddedKVSIndex() if spec.store and spec.mooncake is None else None
    engines: list[MockEngineHandle] = []
    try:
        engines = await start_engines(spec, embedded)
        settings = gateway_settings(spec, policy, engines)
        gateway = await start_gateway(settings, kvs_index=embedded, tokenizer=tokenizer)
        try:
            yield gateway.url
        finally:
            await gateway.close()
    finally:
        await asyncio.gather(*(engine.close() for engine in engines))


async def start_engines(spec: FleetSpec, embedded: EmbeddedKVSIndex | None) -> list[MockEngineHandle]:
    """Every engine of `spec`, publishing to `embedded` (None: spec.mooncake, or no store); none left
    running on failure."""
    started = await asyncio.gather(
        *(_start_engine(spec, i, embedded) for i in range(spec.total_engines)), return_exceptions=True
    )
    engines = [e for e in started if isinstance(e, MockEngineHandle)]
    failures = [e for e in started if isinstance(e, BaseException)]
    if failures:
        await asyncio.gather(*(engine.close() for engine in engines))
        raise failures[0]
    return engines
