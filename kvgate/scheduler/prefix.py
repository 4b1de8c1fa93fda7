"""Where the KV store says blocks live -> how many prompt tokens each instance already holds.

The store names transport endpoints ("127.0.0.2:17901"), not instances. Each instance lists the
endpoints that hold its cache (`kvs_endpoints`): a bare IP matches that host on any port (the
port of a transfer engine is often chosen at run time), "IP:port" matches exactly. The Conductor
indexer names its registered instances (`instance_id`) instead: there an instance without
`kvs_endpoints` is known by its own id.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial
from operator import attrgetter

from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.scheduler.hashing import BlockHash


def split_endpoint(endpoint: str) -> tuple[str, str | None]:
    """ "IP:port" -> (IP, port); "IP" -> (IP, None). IPv6 needs brackets with a port ("[::1]:80")."""
    host, sep, port = endpoint.rpartition(":")
    if sep and port.isdigit() and (":" not in host or host.startswith("[")):
        return host.strip("[]"), port
    return endpoint.strip("[]"), None


class EndpointMap:
    """Store endpoints -> ids of the instances whose cache they hold. Rebuilt when instances change."""

    # Answers are kept: a fleet has few endpoints, and a 128K-token prompt names each one up to
    # 512 times. Bounded anyway, in case a store reports endpoints without end.
    MAX_REMEMBERED = 65536

    def __init__(
        self, by_endpoint: Mapping[str, frozenset[str]], by_host: Mapping[str, frozenset[str]]
    ) -> None:
        self.by_endpoint = by_endpoint  # "IP:port" entries
        self.by_host = by_host  # bare "IP" entries
        self.resolved = _ResolvedEndpoints(self)  # endpoint -> instances, filled on first use

    @classmethod
    def from_instances(
        cls,
        instances: Sequence[InstanceConfig],
        names: Callable[[InstanceConfig], tuple[str, ...]] = attrgetter("kvs_endpoints"),
    ) -> EndpointMap:
        """`names`: the endpoints the store reports an instance's blocks under (its kvs_endpoints)."""
        by_endpoint: dict[str, set[str]] = {}
        by_host: dict[str, set[str]] = {}
        for instance in instances:
            for entry in names(instance):
                host, port = split_endpoint(entry)
                if port is None:
                    by_host.setdefault(host, set()).add(instance.id)
                else:
                    by_endpoint.setdefault(f"{host}:{port}", set()).add(instance.id)
        return cls(
            {k: frozenset(v) for k, v in by_endpoint.items()},
            {k: frozenset(v) for k, v in by_host.items()},
        )

    def instances_at(self, endpoint: str) -> frozenset[str]:
        return self.resolved[endpoint]

    def _resolve(self, endpoint: str) -> frozenset[str]:
        host, port = split_endpoint(endpoint)
        exact = self.by_endpoint.get(f"{host}:{port}", frozenset()) if port else frozenset()
        return exact | self.by_host.get(host, frozenset())


def names_in_store(settings: Settings, instance: InstanceConfig) -> tuple[str, ...]:
    """What the store in use calls the instance: its kvs_endpoints, or, for the Conductor indexer
    (which reports instance ids, not hosts), by default its own id."""
    if instance.kvs_endpoints or settings.kvs_backend != KVSBackendName.CONDUCTOR:
        return instance.kvs_endpoints
    return (instance.id,)


def endpoint_map(settings: Settings, instances: Sequence[InstanceConfig]) -> EndpointMap:
    """The map for the store in use."""
    return EndpointMap.from_instances(instances, partial(names_in_store, settings))


class _ResolvedEndpoints(dict[str, frozenset[str]]):
    """A dict whose misses resolve the endpoint, so that lookups by map() stay in C."""

    def __init__(self, endpoint_map: EndpointMap) -> None:
        super().__init__()
        self._endpoint_map = endpoint_map

    def __missing__(self, endpoint: str) -> frozenset[str]:
        if len(self) >= EndpointMap.MAX_REMEMBERED:
            self.clear()
        instances = self[endpoint] = self._endpoint_map._resolve(endpoint)
        return instances


def prefix_hit_tokens(
    blocks: Sequence[BlockHash],
    locations: Sequence[Collection[str]],
    endpoint_map: EndpointMap,
    num_prompt_tokens: int,
) -> dict[str, int]:
    """Tokens each instance holds contiguously from block 0 (instances with no hit are absent).

    `locations[i]` are the endpoints holding block i. An instance's hit ends at its first missing
    block: a later block it holds cannot be reused without the ones before it. A saved unfull block
    counts its real length; the total is capped at the prompt length.
    """
    resolve = endpoint_map.resolved.__getitem__
    holding: set[str] | None = None  # instances holding every block so far
    hits: dict[str, int] = {}
    covered = 0
    previous: Collection[str] | None = None
    for block, endpoints in zip(blocks, locations, strict=False):
        # Runs of blocks usually live on the same endpoints: within a run the holders cannot change.
        if endpoints != previous:
            here = set().union(*map(resolve, endpoints))
            previous = endpoints
            if holding is None:
                holding = set(here)
            else:
                for instance in holding - here:
                    hits[instance] = covered
                holding &= here
            if not holding:
                break
        covered += block.num_tokens
    for instance in holding or ():
        hits[instance] = covered
    if num_prompt_tokens <= 0:
        return {}
    return {instance: min(tokens, num_prompt_tokens) for instance, tokens in hits.items() if tokens > 0}
