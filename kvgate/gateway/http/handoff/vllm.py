"""vLLM's hand-off through its KV connectors (checked against vLLM and vllm-router, docs/PD.md).

1. The prefill instance gets the body with `kv_transfer_params` asking for a remote decode
   (`do_remote_decode: true`), one output token and no streaming (stream options dropped,
   `min_tokens` capped at 1 so vLLM's min <= max check passes).
2. Its JSON answer carries `kv_transfer_params` (NIXL: remote engine id, block ids, host, port,
   ...). The decode instance gets the client's body with exactly those parameters; its answer
   is relayed.

Mooncake connector (a prefill instance configured with `bootstrap_port`): the prefill pushes the
KV to the decode under a transfer id the router chooses, so kvgate fills the fields itself, as
vllm-router and vLLM's Mooncake proxy do: `transfer_id` on both requests; on the decode request
`do_remote_prefill: true`, `remote_bootstrap_addr` (http://host:port) and `remote_engine_id`, which
the prefill's bootstrap server tells (`GET /query`: engine id per data-parallel rank; kvgate uses
the lowest rank's and remembers it until a lookup fails).
"""

from __future__ import annotations

import secrets

import aiohttp
import orjson

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.http.handoff.base import Body, HandOff, HandOffError, PairAttempt, bootstrap_host

# A NIXL answer for a 128K-token prompt in 16-token blocks holds ~8,000 block ids (~50 KB).
MAX_TRANSFER_PARAMS_BYTES = 1024 * 1024
# A bootstrap server answers its /query at once; only a cache miss waits for it.
_QUERY_TIMEOUT_S = 5.0

# What the prefill request asks for; the null fields are those a NIXL prefill answer fills in.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def mooncake_bootstrap_addr(prefill: InstanceConfig) -> str | None:
    return f"http://{bootstrap_host(prefill)}:{prefill.bootstrap_port}" if prefill.bootstrap_port else None


class _Attempt(PairAttempt):
    def __init__(self, body: Body, prefill: InstanceConfig, request_id: str, engine_id: str | None) -> None:
        self._body = body
        self._mooncake_addr = mooncake_bootstrap_addr(prefill)
        self._engine_id = engine_id
        # New for every try: a retry must not meet the KV a failed try left under the same id.
        self._transfer_id = f"xfer-{request_id}-{secrets.token_hex(4)}"
        params = dict(_REMOTE_DECODE)
        if self._mooncake_addr:
            params["transfer_id"] = self._transfer_id
        prefill_body = {**body, "kv_transfer_params": params, "stream": False, "max_tokens": 1}
        prefill_body.pop("stream_options", None)
        if "max_completion_tokens" in body:
            prefill_body["max_completion_tokens"] = 1
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > 1:
            prefill_body["min_tokens"] = 1
        self.prefill_body = prefill_body

    def decode_body(self, prefill_answer: Body | None) -> Body:
        params = (prefill_answer or {}).get("kv_transfer_params")
        if self._mooncake_addr:
            params = {
                **(params if isinstance(params, dict) else {}),
                "do_remote_decode": False,
                "do_remote_prefill": True,
                "transfer_id": self._transfer_id,
                "remote_bootstrap_addr": self._mooncake_addr,
                "remote_engine_id": self._engine_id,
            }
        if not isinstance(params, dict) or not params:
            raise HandOffError("the prefill answer carries no kv_transfer_params (is a KV connector configured?)")
        check_transfer_params(params)
        return {**self._body, "kv_transfer_params": params}


def check_transfer_params(params: Body) -> None:
    """Refuse parameters no connector sends (HandOffError: the pair is retried): they are passed to
    the decode instance as they are, so an oversized or mistyped one would fail or stall it instead."""
    if len(orjson.dumps(params)) > MAX_TRANSFER_PARAMS_BYTES:
        raise HandOffError(f"the prefill answer's kv_transfer_params exceed {MAX_TRANSFER_PARAMS_BYTES} bytes")
    port = params.get("remote_port")
    if port is not None and (type(port) is not int or not 1 <= port <= 65535):
        raise HandOffError(f"the prefill answer's kv_transfer_params name an impossible remote_port {port!r}")
    blocks = params.get("remote_block_ids")
    if blocks is not None and not _block_ids(blocks):
        raise HandOffError("the prefill answer's kv_transfer_params hold remote_block_ids that are not "
                           "lists of non-negative integers")


def _block_ids(value: object) -> bool:
    """A list of block ids, or (one per KV cache group in recent vLLM) a list of such lists."""
    if not isinstance(value, list):
        return False
    return all(type(v) is int and v >= 0 or isinstance(v, list) and all(type(i) is int and i >= 0 for i in v)
               for v in value)


class VLLMHandOff(HandOff):
    name = "vllm"
    concurrent = False

    def __init__(self) -> None:
        self._engine_ids: dict[str, str] = {}  # Mooncake bootstrap address -> engine id

    async def attempt(self, body: Body, prefill: InstanceConfig, request_id: str) -> PairAttempt:
        address = mooncake_bootstrap_addr(prefill)
        engine_id = await self._engine_id(address) if address else None
        return _Attempt(body, prefill, request_id, engine_id)

    async def _engine_id(self, address: str) -> str:
        if address in self._engine_ids:
            return self._engine_ids[address]
        try:
            timeout = aiohttp.ClientTimeout(total=_QUERY_TIMEOUT_S)
            async with aiohttp.ClientSession(timeout=timeout) as session, session.get(address + "/query") as answer:
                ranks = await answer.json(content_type=None) if answer.status == 200 else None
            engine_id = ranks[min(ranks, key=int)]["engine_id"]
        except (aiohttp.ClientError, TimeoutError, ValueError, LookupError, TypeError) as exc:
            raise HandOffError(f"the Mooncake bootstrap server {address} did not name its engine: {exc!r}") from None
        if not isinstance(engine_id, str):
            raise HandOffError(f"the Mooncake bootstrap server {address} named no engine id")
        self._engine_ids[address] = engine_id
        return engine_id

    def forget(self, prefill: InstanceConfig) -> None:
        # The instance may have restarted under another engine id.
        address = mooncake_bootstrap_addr(prefill)
        if address:
            self._engine_ids.pop(address, None)

    def local_body(self, body: Body) -> Body:
        # Explicitly local: the connector computes the prompt on the decode instance.
        return {**body, "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False}}
