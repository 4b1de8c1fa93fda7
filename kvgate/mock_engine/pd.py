"""A mock engine's part in prefill/decode disaggregation, for both hand-offs, over real HTTP.

Prefill role: a request carrying a hand-off (SGLang's bootstrap room, vLLM's `kv_transfer_params`
with `do_remote_decode`) is computed as usual and its prompt blocks are then offered under a
handle, served by `GET /kv_transfer/{handle}` on the engine's port and, when configured, on its
bootstrap port (SGLang's bootstrap server, the Mooncake connector's). vLLM answers carry the
`kv_transfer_params` a decode instance needs, in the NIXL connector's shape.

Decode role: a request must carry a valid hand-off, or it is refused with a 400 naming what is
missing, so a router that bypasses the prefill stage fails loudly. With one, the engine pulls the
prompt's blocks from the prefill engine (waiting for them while the prefill still runs), spends
the modelled transfer time, puts them in its own cache and decodes. vLLM's explicit local marker
(`do_remote_prefill: false`) makes the decode engine compute the prompt itself (skip-prefill).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import json_response

# How long a pull waits for the prefill engine to offer the blocks (SGLang sends both at once).
PULL_WAIT_S = 30.0
# Bounded memory: blocks never pulled (a decode that never came) leave after this many offers.
_MAX_OFFERS = 4096


@dataclass(frozen=True)
class PDRole:
    role: str  # "prefill" | "decode"
    protocol: str  # "sglang" | "vllm"
    # Modelled KV transfer rate between the engines (prompt tokens per modelled second).
    kv_transfer_tokens_per_s: float = 200_000.0
    bootstrap_port: int | None = None
    # Prefill: the link its KV leaves by (a remote Prefill-as-a-Service cluster's egress, prompt
    # tokens per modelled second); transfers queue on it one at a time. None: no such link.
    egress_tokens_per_s: float | None = None


@dataclass(frozen=True)
class _Blocks:
    block_keys: tuple[str, ...]
    num_tokens: int
    # Prompt tokens the prefill engine found in its own cache: the decode engine reports them as
    # its answer's cached tokens, so usage tells what the prefill routing saved.
    cached_tokens: int


@dataclass
class Exchange:
    """One request's hand-off as the engine serves it."""

    handle: str | None = None  # prefill: the blocks are offered under it once computed
    answer_fields: dict[str, Any] = field(default_factory=dict)  # prefill: added to a whole answer
    received: _Blocks | None = None  # decode: what came from the prefill engine
    cached_tokens: int = 0  # set when the request finishes

    def reported_cached_tokens(self) -> int:
        return self.received.cached_tokens if self.received is not None else self.cached_tokens


class KVOutbox:
    """Prefill side: the blocks of finished prefills, by handle, until a decode engine pulls them."""

    def __init__(self) -> None:
        self._offers: dict[str, asyncio.Future[_Blocks]] = {}

    def _slot(self, handle: str) -> asyncio.Future[_Blocks]:
        if handle not in self._offers:
            if len(self._offers) >= _MAX_OFFERS:
                oldest = next(iter(self._offers))
                self._offers.pop(oldest).cancel()
            self._offers[handle] = asyncio.get_running_loop().create_future()
        return self._offers[handle]

    def offer(self, handle: str, blocks: _Blocks) -> None:
        slot = self._slot(handle)
        if not slot.done():
            slot.set_result(blocks)

    async def take(self, handle: str, wait_s: float) -> _Blocks | None:
        slot = self._slot(handle)
        try:
            return await asyncio.wait_for(asyncio.shield(slot), wait_s)
        except TimeoutError:
            return None
        finally:
            if slot.done():
                self._offers.pop(handle, None)


class PDEngineRole:
    def __init__(self, role: PDRole, engine_id: str, time_scale: float) -> None:
        self.role = role
        self._engine_id = engine_id
        self._time_scale = time_scale
        self.outbox = KVOutbox()
        self._block_ids = itertools.count(1)
        self._session: aiohttp.ClientSession | None = None
        self._egress = asyncio.Lock()  # the egress link carries one transfer at a time

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/kv_transfer/{handle}", self._serve_blocks)
        if self.role.role == "prefill":
            app.router.add_get("/query", self._query)

    async def _query(self, request: web.Request) -> web.Response:
        """vLLM's Mooncake bootstrap server: the engine id per data-parallel rank (one rank here)."""
        return json_response({"0": {"engine_id": self._engine_id}})

    async def _serve_blocks(self, request: web.Request) -> web.Response:
        blocks = await self.outbox.take(request.match_info["handle"], PULL_WAIT_S)
        if blocks is None:
            raise APIError(404, f"no KV under handle {request.match_info['handle']!r}")
        if self.role.egress_tokens_per_s:
            async with self._egress:
                await asyncio.sleep(blocks.num_tokens / self.role.egress_tokens_per_s * self._time_scale)
        return json_response({"block_keys": list(blocks.block_keys), "num_tokens": blocks.num_tokens,
                              "cached_tokens": blocks.cached_tokens})

    # --- prefill side ---

    def prefill_exchange(self, body: dict[str, Any], engine_url: str) -> Exchange:
        """The handle a prefill request's blocks are offered under, and the fields of its answer."""
        if self.role.protocol == "sglang":
            room = body.get("bootstrap_room")
            if not isinstance(room, int) or isinstance(room, bool):
                raise APIError(400, "prefill instance: the request carries no bootstrap_room", param="bootstrap_room")
            return Exchange(handle=f"room-{room}")
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict) or params.get("do_remote_decode") is not True:
            raise APIError(400, "prefill instance: kv_transfer_params must ask for do_remote_decode",
                           param="kv_transfer_params")
        if isinstance(params.get("transfer_id"), str):  # Mooncake: the router named the transfer
            return Exchange(handle=params["transfer_id"])
        block_id = next(self._block_ids)
        host, _, port = engine_url.removeprefix("http://").rpartition(":")
        # NIXL's answer shape: where the decode engine reads the blocks from.
        return Exchange(handle=f"nixl-{block_id}", answer_fields={"kv_transfer_params": {
            "do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self._engine_id,
            "remote_block_ids": [block_id], "remote_host": host, "remote_port": int(port), "tp_size": 1,
        }})

    def offer(self, exchange: Exchange, block_keys: tuple[str, ...], num_tokens: int) -> None:
        if exchange.handle is not None:
            self.outbox.offer(exchange.handle, _Blocks(block_keys, num_tokens, exchange.cached_tokens))

    # --- decode side ---

    async def receive(self, body: dict[str, Any], num_prompt_tokens: int) -> Exchange:
        """The prompt's blocks pulled from the prefill engine (none: compute the prompt here)."""
        url = self._source(body)
        if url is None:
            return Exchange()
        if self._session is None:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=PULL_WAIT_S + 5))
        try:
            async with self._session.get(url) as answer:
                if answer.status != 200:
                    raise APIError(502, f"decode instance: no KV at {url} (HTTP {answer.status})")
                pulled = await answer.json()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise APIError(502, f"decode instance: KV transfer from {url} failed: {exc!r}") from None
        if pulled["num_tokens"] != num_prompt_tokens:
            raise APIError(400, f"decode instance: the KV received covers {pulled['num_tokens']} tokens, "
                           f"the prompt has {num_prompt_tokens}")
        # The transfer itself: modelled time for the prompt's KV over the interconnect.
        await asyncio.sleep(num_prompt_tokens / self.role.kv_transfer_tokens_per_s * self._time_scale)
        return Exchange(received=_Blocks(tuple(pulled["block_keys"]), num_prompt_tokens, pulled["cached_tokens"]))

    def _source(self, body: dict[str, Any]) -> str | None:
        if self.role.protocol == "sglang":
            host, port, room = body.get("bootstrap_host"), body.get("bootstrap_port"), body.get("bootstrap_room")
            if not (isinstance(host, str) and isinstance(port, int) and isinstance(room, int)):
                raise APIError(400, "decode instance: the request carries no bootstrap_host, bootstrap_port "
                               "and bootstrap_room (send it through a prefill/decode router)", param="bootstrap_room")
            return f"http://{host}:{port}/kv_transfer/room-{room}"
        params = body.get("kv_transfer_params")
        if not isinstance(params, dict):
            raise APIError(400, "decode instance: the request carries no kv_transfer_params (send it through a "
                           "prefill/decode router)", param="kv_transfer_params")
        if params.get("do_remote_prefill") is not True:
            return None
        if isinstance(params.get("remote_bootstrap_addr"), str):  # Mooncake connector
            if not (isinstance(params.get("transfer_id"), str) and isinstance(params.get("remote_engine_id"), str)):
                raise APIError(400, "decode instance: kv_transfer_params with remote_bootstrap_addr need transfer_id "
                               "and remote_engine_id", param="kv_transfer_params")
            return f"{params['remote_bootstrap_addr']}/kv_transfer/{params['transfer_id']}"
        host, port, block_ids = params.get("remote_host"), params.get("remote_port"), params.get("remote_block_ids")
        if not (isinstance(host, str) and isinstance(port, int) and isinstance(block_ids, list) and block_ids):
            raise APIError(400, "decode instance: kv_transfer_params lack remote_host, remote_port and "
                           "remote_block_ids", param="kv_transfer_params")
        return f"http://{host}:{port}/kv_transfer/nixl-{block_ids[0]}"
