"""A conformance double of Mooncake's Conductor KV indexer (`POST /query`), for tests only.

Mooncake's Conductor is a Go service that no package ships (there is no wheel or PyPI release of
it), so it cannot run here. This double implements its documented HTTP query API
(Mooncake docs: api-reference/http/conductor-indexer.md and design/conductor/
conductor-architecture-design.md) over a real prefix table, so that kvgate's backend is tested
against the documented contract rather than against canned answers:

- blocks are identified the documented way: the complete blocks of `token_ids` hashed with XXH3-64
  and a seed of the service's own (random here, as CONDUCTOR_SEED is by default), rolled from block
  to block, so a client could not guess the hashes;
- the table is scoped by (tenant_id, model, lora_name, block_size, cache_salt) and holds, per
  block, which instance has it on which medium and DP rank;
- `/query` walks the prompt's blocks from the first and answers, for every instance registered
  under the tenant (or the one `instance_id` asked), `longest_matched` (blocks held on any medium),
  each medium's own prefix (`GPU`, `CPU`, `DISK`, and any other medium stored) and `DP` (each
  rank's prefix), all in tokens.

Instead of consuming KV events from engines over ZMQ (`/register`), tests fill the table with
`store` / `remove`. `fail_with` and `delay_s` make the service misbehave.
"""

from __future__ import annotations

import asyncio
import os
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import xxhash
from aiohttp import web

_Context = tuple[str, str, str, int, str]  # tenant, model, lora_name, block_size, cache_salt
_REPORTED_MEDIA = ("GPU", "CPU", "DISK")  # always present in an instance's answer


@dataclass
class _Holding:
    """Who holds one block: instance -> medium -> DP ranks."""

    by_instance: dict[str, dict[str, set[int]]] = field(default_factory=dict)


class ConductorDouble:
    def __init__(self) -> None:
        self.seed = int.from_bytes(os.urandom(8), "little")
        self._blocks: dict[_Context, dict[int, _Holding]] = {}
        self._registered: dict[str, dict[str, set[int]]] = {}  # tenant -> instance -> DP ranks
        self.requests: list[dict[str, Any]] = []  # every /query body received, in order
        self.fail_with: tuple[int, bytes] | None = None  # answer every query with (status, body)
        self.delay_s = 0.0
        self.url = ""
        self._runner: web.AppRunner | None = None

    # --- the table (in place of KV events) ---

    def store(self, instance_id: str, token_ids: Sequence[int], medium: str, *, model: str, block_size: int,
              tenant: str = "default", lora_name: str = "", cache_salt: str = "", dp_rank: int = 0) -> int:
        """`instance_id` holds the complete blocks of `token_ids` on `medium`; returns the block count."""
        hashes = self.block_hashes(token_ids, block_size)
        table = self._blocks.setdefault((tenant, model, lora_name, block_size, cache_salt), {})
        for block_hash in hashes:
            media = table.setdefault(block_hash, _Holding()).by_instance.setdefault(instance_id, {})
            media.setdefault(medium.upper(), set()).add(dp_rank)
        self.register(instance_id, tenant, dp_rank)
        return len(hashes)

    def remove(self, instance_id: str, token_ids: Sequence[int], medium: str, *, model: str, block_size: int,
               tenant: str = "default", lora_name: str = "", cache_salt: str = "") -> None:
        """The blocks of `token_ids` leave `medium` at `instance_id` (an eviction)."""
        table = self._blocks.get((tenant, model, lora_name, block_size, cache_salt), {})
        for block_hash in self.block_hashes(token_ids, block_size):
            holding = table.get(block_hash)
            if holding is not None and instance_id in holding.by_instance:
                holding.by_instance[instance_id].pop(medium.upper(), None)

    def register(self, instance_id: str, tenant: str = "default", dp_rank: int = 0) -> None:
        self._registered.setdefault(tenant, {}).setdefault(instance_id, set()).add(dp_rank)

    def block_hashes(self, token_ids: Sequence[int], block_size: int) -> list[int]:
        """Rolling XXH3-64 over complete blocks: seq[0] = local[0], seq[i] = H(seq[i-1] || local[i])."""
        hashes: list[int] = []
        for start in range(0, len(token_ids) - block_size + 1, block_size):
            local = xxhash.xxh3_64_intdigest(struct.pack(f"<{block_size}I", *token_ids[start:start + block_size]),
                                             seed=self.seed)
            hashes.append(local if not hashes else
                          xxhash.xxh3_64_intdigest(struct.pack("<QQ", hashes[-1], local), seed=self.seed))
        return hashes

    # --- the HTTP service ---

    async def start(self) -> ConductorDouble:
        app = web.Application()
        app.router.add_post("/query", self._query)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        self.url = f"http://{host}:{port}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _query(self, request: web.Request) -> web.Response:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": "invalid JSON"}, status=400)
        if isinstance(body, dict):
            self.requests.append(body)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.fail_with is not None:
            status, text = self.fail_with
            return web.Response(status=status, body=text, content_type="application/json")
        problem = _invalid(body)
        if problem:
            return web.json_response({"error": problem}, status=400)
        return web.Response(body=orjson.dumps(self.answer(body)), content_type="application/json")

    def answer(self, body: dict[str, Any]) -> dict[str, Any]:
        tenant = body.get("tenant_id") or "default"
        block_size = body["block_size"]
        context = (tenant, body["model"], body.get("lora_name") or "", block_size, body.get("cache_salt") or "")
        table = self._blocks.get(context, {})
        hashes = self.block_hashes(body["token_ids"], block_size)
        registered = self._registered.get(tenant, {})
        asked = [body["instance_id"]] if body.get("instance_id") else sorted(registered)
        return {tenant: {instance: _instance_matches(instance, registered.get(instance, set()), hashes, table,
                                                     block_size)
                         for instance in asked}}


def _instance_matches(instance: str, ranks: set[int], hashes: list[int], table: dict[int, _Holding],
                      block_size: int) -> dict[str, Any]:
    """Prefixes from block 0, in tokens: on any medium, per medium, per DP rank."""
    longest = 0
    media: dict[str, int] = dict.fromkeys(_REPORTED_MEDIA, 0)
    open_media: set[str] | None = None  # media holding every block so far
    dp = dict.fromkeys(sorted(ranks), 0)
    open_ranks = set(ranks)
    for depth, block_hash in enumerate(hashes, start=1):
        held = table.get(block_hash, _Holding()).by_instance.get(instance, {})
        here = {medium for medium, on_ranks in held.items() if on_ranks}
        if not here:
            break
        longest = depth
        open_media = here if open_media is None else open_media & here
        for medium in open_media:
            media[medium] = depth
        open_ranks &= set().union(*held.values())
        for rank in open_ranks:
            dp[rank] = depth
    return {"longest_matched": longest * block_size,
            **{medium: blocks * block_size for medium, blocks in media.items()},
            "DP": {str(rank): blocks * block_size for rank, blocks in dp.items()}}


def _invalid(body: Any) -> str:
    """Why a /query body breaks the documented contract ("" when it does not)."""
    if not isinstance(body, dict):
        return "the body must be a JSON object"
    if not isinstance(body.get("model"), str) or not body["model"]:
        return "model is required"
    tokens = body.get("token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
        return "token_ids must be a list of u32"
    if type(body.get("block_size")) is not int or body["block_size"] <= 0:
        return "block_size must be a positive integer"
    if "lora_name" in body and "lora_id" in body:
        return "lora_name and lora_id are exclusive"
    return ""
