"""Ask Mooncake's Conductor KV indexer which instances hold a prompt's prefix, and on which media.

    POST {kvs_conductor_url}/query
    {"model": "qwen", "token_ids": [...], "block_size": 256, "tenant_id": "default",
     "lora_name": "...", "cache_salt": "..."}            (the last two only when configured)
 -> {"default": {"vllm-node1": {"longest_matched": 512, "GPU": 256, "CPU": 512, "DISK": 0,
                                "DP": {"0": 512}}, ...}}

(Mooncake's documentation: api-reference/http/conductor-indexer.md.) The indexer hashes the token
ids itself and counts complete blocks only. kvgate never uses `/query_by_hash`: its rolling XXH3
hashes are seeded with the service's CONDUCTOR_SEED, random unless the operator fixes it, so a client
cannot compute them reliably. No `instance_id` is sent: every instance registered under the tenant
answers.

The answer becomes the per-key view every backend gives (KVSAnswer), the indexer's `instance_id`
standing for the endpoint (an instance's `kvs_endpoints` name its indexer ids; empty, its own id):

- block i is held in memory at X when X's prefix on a memory medium covers the whole block;
- block i is on X's disk tier when X's prefix on any medium (`longest_matched`) covers it but no
  memory medium does; asked for only with --kvs-query-disk-tier, as for the Mooncake master.

Media are fields with an integer value, named in any case. gpu, npu, hbm, device (an engine's
accelerator memory) and cpu, cpu_pinned, host, dram (host memory) are memory; every other medium
(disk, ssd, 3fs, nfs, external, names added later) is priced as disk, the slowest tier kvgate
models, so an unknown medium never promises a memory-speed load. Fields holding objects (`DP`,
per-rank detail) are not media. The medium counts are read as prefixes from block 0 whether the
indexer reports each medium on its own or cumulatively along GPU -> CPU -> DISK: the memory prefix
is the longest memory count either way.

What this view loses:
- DP ranks: an instance's prefix is the best of its ranks; which rank holds it is dropped.
- GPU against CPU: both are memory. The scheduler prices memory blocks held by another instance as
  loadable over the network, true for Mooncake's DRAM pool, but a block in one engine's GPU alone
  can only be reused by that engine: other instances are told they could load it when they cannot.

Anything but HTTP 200 with a well-formed answer raises KVSQueryError, as does an answer longer
than --kvs-max-answer-bytes (unread).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.kvs_client.base import Endpoints, HashedPrompt, KVSAnswer, KVSQueryError
from kvgate.kvs_client.http_store import StoreSession

QUERY_PATH = "/query"
_MEMORY_MEDIA = frozenset({"gpu", "npu", "hbm", "device", "cpu", "cpu_pinned", "host", "dram"})
_LONGEST = "longest_matched"


class ConductorIndexerBackend:
    name = "conductor"

    def __init__(
        self,
        base_url: str,
        *,
        block_size: int,
        request_timeout_s: float,
        tenant: str = "default",
        model: str = "",
        lora_name: str = "",
        cache_salt: str = "",
        include_disk_tier: bool = False,
        max_answer_bytes: int = 1024 * 1024,
        max_connections: int = 64,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.block_size = block_size
        self.tenant = tenant
        self.model = model  # "" = the request's
        self.lora_name = lora_name
        self.cache_salt = cache_salt
        self.include_disk_tier = include_disk_tier
        self.max_answer_bytes = max_answer_bytes
        self._session = StoreSession(max_connections=max_connections, request_timeout_s=request_timeout_s)

    async def query(self, keys: Sequence[str], prompt: HashedPrompt | None = None) -> KVSAnswer:
        if prompt is None:
            raise KVSQueryError("the Conductor indexer is asked by token ids and this lookup carries none")
        # The complete blocks among the asked keys' (the lookup may ask fewer blocks than the prompt
        # has); the indexer ignores a partial block anyway.
        complete_blocks = min(len(keys), len(prompt.token_ids) // self.block_size)
        if not complete_blocks:
            return KVSAnswer({}, {})
        token_ids = prompt.token_ids[: complete_blocks * self.block_size]
        model = self.model or prompt.model
        if not model:
            raise KVSQueryError("no model to ask the Conductor indexer for: set kvs_conductor_model")
        document = await self._post(self.request_body(model, token_ids))
        prefixes = parse_answer(document, self.tenant, len(token_ids))
        return to_key_view(prefixes, keys, self.block_size, self.include_disk_tier)

    def request_body(self, model: str, token_ids: Sequence[int]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": model,
            "token_ids": token_ids,
            "block_size": self.block_size,
            "tenant_id": self.tenant,
        }
        if self.lora_name:
            body["lora_name"] = self.lora_name
        if self.cache_salt:
            body["cache_salt"] = self.cache_salt
        return body

    async def close(self) -> None:
        await self._session.close()

    async def _post(self, body: dict[str, Any]) -> Any:
        return await self._session.json(
            "POST", self.base_url + QUERY_PATH, f"POST {self.base_url}{QUERY_PATH}", self.max_answer_bytes,
            data=orjson.dumps(body), headers={"Content-Type": "application/json"},
        )


@dataclass(frozen=True, slots=True)
class InstancePrefix:
    """One instance's tokens held contiguously from the prompt's start: in memory, and anywhere."""

    memory_tokens: int
    held_tokens: int


def parse_answer(document: Any, tenant: str, asked_tokens: int) -> dict[str, InstancePrefix]:
    """The tenant's instances and their prefixes; KVSQueryError for anything off the documented shape.
    Other tenants are ignored; a tenant absent from the answer has no instance holding anything."""
    if not isinstance(document, dict):
        raise KVSQueryError(f"Conductor answer is not a JSON object: {str(document)[:200]}")
    instances = document.get(tenant, {})
    if not isinstance(instances, dict):
        raise KVSQueryError(f"Conductor answer for tenant {tenant!r} is not an object")
    return {instance_id: _instance_prefix(instance_id, entry, asked_tokens)
            for instance_id, entry in instances.items()}


def _instance_prefix(instance_id: str, entry: Any, asked_tokens: int) -> InstancePrefix:
    if not isinstance(entry, dict):
        raise KVSQueryError(f"Conductor answer for instance {instance_id!r} is not an object")
    longest: int | None = None
    memory = held = 0
    for field, value in entry.items():
        if isinstance(value, (dict, list)):
            continue  # per-rank detail (DP), not a medium
        if type(value) is not int or not 0 <= value <= asked_tokens:
            raise KVSQueryError(f"Conductor answer for instance {instance_id!r}: {field} = {value!r} is not "
                                f"a token count between 0 and the {asked_tokens} asked")
        name = field.lower()
        if name == _LONGEST:
            longest = value
        elif name in _MEMORY_MEDIA:
            memory = max(memory, value)
        held = max(held, value)
    if longest is None:
        raise KVSQueryError(f"Conductor answer for instance {instance_id!r} has no {_LONGEST}")
    return InstancePrefix(memory, held)


def to_key_view(
    prefixes: Mapping[str, InstancePrefix], keys: Sequence[str], block_size: int, include_disk_tier: bool
) -> KVSAnswer:
    """Per key, the instances holding its block in memory and (if asked) on disk only.

    Holders change only where an instance's prefix ends, so the blocks are walked in spans between
    those ends: a few spans per prompt whatever its length, each sharing one endpoints tuple.
    """
    count = len(keys)
    # Whole blocks only: the indexer matches complete blocks, so a partial block is never held.
    memory = {i: min(p.memory_tokens // block_size, count) for i, p in prefixes.items()}
    held = {i: min(p.held_tokens // block_size, count) for i, p in prefixes.items()}
    ends = sorted({0, *memory.values(), *(held.values() if include_disk_tier else ())})
    locations: dict[str, Endpoints] = {}
    disk_locations: dict[str, Endpoints] = {}
    for start, end in zip(ends, ends[1:], strict=False):
        in_memory = tuple(sorted(i for i, blocks in memory.items() if blocks >= end))
        on_disk = tuple(sorted(i for i, blocks in held.items() if blocks >= end and memory[i] <= start))
        for key in keys[start:end]:
            if in_memory:
                locations[key] = in_memory
            if include_disk_tier and on_disk:
                disk_locations[key] = on_disk
    return KVSAnswer(locations, disk_locations)
