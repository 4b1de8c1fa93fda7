"""Ask the Mooncake master's admin HTTP server where blocks live.

    GET http://{host}:{port}/batch_query_keys?keys=k1,k2,...

The master URL-decodes the `keys` value and splits it on ",", then answers every key:

    {"success": true, "data": {
        "k1": {"ok": true, "values": [{"transport_endpoint_": "127.0.0.2:17901", ...}],
               "disk_values": null, "local_disk_values": null, "nof_values": null, ...},
        "k2": {"ok": false, "error": "OBJECT_NOT_FOUND", "values": null, ...}}}

Unset fields are JSON null. `values` are memory replicas (the tier kvgate routes on); the lower
tier is `local_disk_values[].transport_endpoint` (a host's SSD; note: no trailing underscore),
`nof_values[].transport_endpoint_` (NVMe-oF) and `disk_values` (shared file storage, readable
from every host, reported as SHARED_STORAGE).

All keys of a lookup go in one request unless the URL would exceed `max_url_bytes`; longer
lists are split into requests under that size, sent concurrently. Because the master splits
on "," after decoding, a key containing "," cannot be asked at all: such keys are answered
as held nowhere without asking (a warning is logged once).

Anything but a well-formed success answer for every asked key raises KVSQueryError. So does an
answer longer than `max_answer_bytes` (KVSAnswerTooLarge), unread: parsing megabytes of JSON costs
every request tens of milliseconds of the event loop, and the store is advice, not a dependency.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from yarl import URL

from kvgate.kvs_client.base import SHARED_STORAGE, Endpoints, HashedPrompt, KVSAnswer, KVSQueryError
from kvgate.kvs_client.http_store import StoreSession

log = logging.getLogger(__name__)

QUERY_PATH = "/batch_query_keys"
_KEYS_PREFIX = f"{QUERY_PATH}?keys="
# A key the master would split in two.
_UNASKABLE = ","
# Characters that never need percent-encoding; block keys (hex digits, "_") usually have no other.
_URL_SAFE = re.compile(r"[A-Za-z0-9_.~-]*")


def _encode(key: str) -> str:
    # Everything else is quoted, so "%", "+", "&" reach the master (which decodes once) intact.
    # The regex check first: quote() costs ~10 us per key, a lot at 4096 keys.
    return key if _URL_SAFE.fullmatch(key) else quote(key, safe="")


@dataclass(frozen=True)
class BatchRequest:
    keys: list[str]
    url: str  # already percent-encoded


class MooncakeMasterBackend:
    name = "mooncake"

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float,
        max_url_bytes: int = 131072,
        include_disk_tier: bool = False,
        max_connections: int = 64,
        max_answer_bytes: int = 1024 * 1024,
    ) -> None:
        self.max_answer_bytes = max_answer_bytes
        self.base_url = base_url.rstrip("/")
        self.max_url_bytes = max_url_bytes
        self.include_disk_tier = include_disk_tier
        self._session = StoreSession(max_connections=max_connections, request_timeout_s=request_timeout_s)
        self._warned_unaskable = False

    async def query(self, keys: Sequence[str], prompt: HashedPrompt | None = None) -> KVSAnswer:
        # Keyed by kvgate's block keys: the prompt they were hashed from is not needed.
        askable = list(dict.fromkeys(key for key in keys if _UNASKABLE not in key))
        if len(askable) < len(set(keys)) and not self._warned_unaskable:
            self._warned_unaskable = True
            log.warning("block keys containing %r cannot be asked of the Mooncake master; treated as absent",
                        _UNASKABLE)
        if not askable:
            return KVSAnswer({}, {})
        batches = self.plan_requests(askable)
        if len(batches) == 1:
            return await self._query_batch(batches[0])
        try:
            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(self._query_batch(batch)) for batch in batches]
        except* KVSQueryError as failures:
            # The first failure says enough; the sibling requests were cancelled by the group.
            raise failures.exceptions[0] from None
        locations: dict[str, Endpoints] = {}
        disk_locations: dict[str, Endpoints] = {}
        for task in tasks:
            answer = task.result()
            locations.update(answer.locations)
            disk_locations.update(answer.disk_locations)
        return KVSAnswer(locations, disk_locations)

    async def close(self) -> None:
        await self._session.close()

    def plan_requests(self, keys: Sequence[str]) -> list[BatchRequest]:
        """Group keys so each request URL stays under max_url_bytes (a lone huge key goes alone)."""
        prefix = self.base_url + _KEYS_PREFIX
        budget = self.max_url_bytes - len(prefix)
        batches: list[BatchRequest] = []
        batch_keys: list[str] = []
        encoded: list[str] = []
        size = 0
        for key in keys:
            piece = _encode(key)
            if batch_keys and size + 1 + len(piece) > budget:
                batches.append(BatchRequest(batch_keys, prefix + ",".join(encoded)))
                batch_keys, encoded, size = [], [], 0
            size += len(piece) + (1 if batch_keys else 0)
            batch_keys.append(key)
            encoded.append(piece)
        if batch_keys:
            batches.append(BatchRequest(batch_keys, prefix + ",".join(encoded)))
        return batches

    async def _query_batch(self, batch: BatchRequest) -> KVSAnswer:
        document = await self._session.json("GET", URL(batch.url, encoded=True), f"GET {self.base_url}{QUERY_PATH}",
                                            self.max_answer_bytes)
        return self._parse(document, batch.keys)

    def _parse(self, document: Any, keys: list[str]) -> KVSAnswer:
        if not isinstance(document, dict) or document.get("success") is not True:
            error = document.get("error") if isinstance(document, dict) else None
            raise KVSQueryError(f"Mooncake master refused the query: {error or str(document)[:200]}")
        data = document.get("data")
        if not isinstance(data, dict):
            raise KVSQueryError(f"Mooncake answer has no 'data' object: {str(document)[:200]}")
        locations: dict[str, Endpoints] = {}
        disk_locations: dict[str, Endpoints] = {}
        for key in keys:
            entry = data.get(key)
            if not isinstance(entry, dict):
                raise KVSQueryError(f"Mooncake answer lacks key {key!r} or it is not an object")
            if entry.get("ok") is not True:
                # OBJECT_NOT_FOUND, or a replica not ready yet: either way nothing to route on.
                continue
            memory = _endpoints(entry.get("values"), "transport_endpoint_", key)
            if memory:
                locations[key] = memory
            if self.include_disk_tier:
                disk = _disk_endpoints(entry, key)
                if disk:
                    disk_locations[key] = disk
        return KVSAnswer(locations, disk_locations)


def _endpoints(replicas: Any, field: str, key: str) -> Endpoints:
    """Endpoints of a replica list (null = none), deduplicated in the master's order."""
    if replicas is None:
        return ()
    if not isinstance(replicas, list):
        raise KVSQueryError(f"Mooncake answer for {key!r}: replicas are not a list")
    found: dict[str, None] = {}
    for replica in replicas:
        endpoint = replica.get(field) if isinstance(replica, dict) else None
        if not isinstance(endpoint, str):
            raise KVSQueryError(f"Mooncake answer for {key!r}: replica without a string {field}")
        found[endpoint] = None
    return tuple(found)


def _disk_endpoints(entry: dict[str, Any], key: str) -> Endpoints:
    local = _endpoints(entry.get("local_disk_values"), "transport_endpoint", key)
    nof = _endpoints(entry.get("nof_values"), "transport_endpoint_", key)
    shared = (SHARED_STORAGE,) if entry.get("disk_values") else ()
    return tuple(dict.fromkeys(local + nof + shared))
