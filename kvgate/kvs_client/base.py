"""The one question kvgate asks a KV store: which endpoints hold these block keys?

Backends (Mooncake master, Redis index, embedded index, Conductor indexer) implement `KVSBackend`:
one `query` that either answers for every asked key or raises `KVSQueryError`. They do no retrying and
no down-gating; ResilientKVSClient adds that once for all of them and turns every outcome
into a `KVSLookup`, which is what the rest of kvgate sees.

An endpoint is the "IP:port" string the store reports for the host holding the block
(Mooncake's `transport_endpoint_`; the Conductor indexer reports its `instance_id`s instead);
mapping endpoints to instances is the scheduler's job.

A query also carries the prompt the keys were hashed from (`HashedPrompt`), for a store that hashes
token ids itself (the Conductor indexer). Stores keyed by kvgate's block keys ignore it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

Endpoints = tuple[str, ...]

# A disk-tier "endpoint" meaning the block sits on storage shared by every host (Mooncake
# `disk_values`: a file on a distributed file system), so any instance can load it.
SHARED_STORAGE = "*"

LookupStatus = Literal["ok", "down", "error", "skipped"]


class KVSQueryError(Exception):
    """A backend could not answer: transport failure, timeout, error reply or unexpected shape."""


class KVSAnswerTooLarge(KVSQueryError):
    """The answer was longer than --kvs-max-answer-bytes and was not parsed."""


@dataclass(frozen=True)
class KVSAnswer:
    """A backend's answer. Keys missing from `locations` are held nowhere.

    `disk_locations` is the lower tier (local or shared disk); empty when the backend has none
    or was not asked for it.
    """

    locations: Mapping[str, Endpoints]
    disk_locations: Mapping[str, Endpoints] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HashedPrompt:
    """The token ids a lookup's keys were computed from: key i covers the i-th chunk of them
    (the ids may stop short of the prompt, but cover every asked key's chunk). `model`: the
    request's model, "" when unknown."""

    token_ids: Sequence[int]
    model: str = ""


@runtime_checkable
class KVSBackend(Protocol):
    name: str

    async def query(self, keys: Sequence[str], prompt: HashedPrompt | None = None) -> KVSAnswer:
        """Answer for all `keys` or raise KVSQueryError (never a partial answer)."""
        ...

    async def close(self) -> None: ...


@dataclass(frozen=True)
class KVSLookup:
    """What callers get back: always a value, never an exception.

    status:
      ok       the store answered; `locations[i]` are the endpoints holding `keys[i]`
      down     the store is marked down; it was not asked (no hits)
      error    the store failed or the time budget ran out (no hits)
      skipped  nothing was asked (no keys, or a probe of a down store is already running)
    """

    status: LookupStatus
    locations: list[Endpoints]
    disk_locations: list[Endpoints]
    elapsed_s: float

    @classmethod
    def empty(cls, status: LookupStatus, key_count: int, elapsed_s: float = 0.0) -> KVSLookup:
        return cls(status, [()] * key_count, [()] * key_count, elapsed_s)

    @property
    def hit_count(self) -> int:
        """Keys held in memory somewhere."""
        return sum(1 for endpoints in self.locations if endpoints)
