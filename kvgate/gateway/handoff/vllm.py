"""vLLM's hand-off through its KV connectors (checked against vLLM and vllm-router, docs/PD.md).

1. The prefill instance gets the body with `kv_transfer_params` asking for a remote decode
   (`do_remote_decode: true`), one output token and no streaming (stream options dropped,
   `min_tokens` capped at 1 so vLLM's min <= max check passes).
2. Its JSON answer carries `kv_transfer_params` (NIXL: remote engine id, block ids, host, port,
   ...). The decode instance gets the client's body with exactly those parameters; its answer
   is relayed.

Mooncake connector (a prefill instance configured with `bootstrap_port`): the decode side pulls
from the prefill's bootstrap server under a transfer id the router chooses, so kvgate fills them
itself, as vllm-router and vLLM's Mooncake proxy do: `transfer_id` on both requests and
`remote_bootstrap_addr` (http://host:port), `do_remote_prefill: true` on the decode request; the
prefill answer's own parameters (such as `remote_engine_id`) are kept.
"""

from __future__ import annotations

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.handoff.base import Body, HandOff, HandOffError, PairAttempt, bootstrap_host

# What the prefill request asks for; the null fields are those a NIXL prefill answer fills in.
_REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class _Attempt(PairAttempt):
    def __init__(self, body: Body, prefill: InstanceConfig, request_id: str) -> None:
        self._body = body
        self._mooncake_addr = (
            f"http://{bootstrap_host(prefill)}:{prefill.bootstrap_port}" if prefill.bootstrap_port else None
        )
        self._transfer_id = f"xfer-{request_id}"
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
            }
        if not isinstance(params, dict) or not params:
            raise HandOffError("the prefill answer carries no kv_transfer_params (is a KV connector configured?)")
        return {**self._body, "kv_transfer_params": params}


class VLLMHandOff(HandOff):
    name = "vllm"
    concurrent = False

    def attempt(self, body: Body, prefill: InstanceConfig, request_id: str) -> PairAttempt:
        return _Attempt(body, prefill, request_id)

    def local_body(self, body: Body) -> Body:
        # Explicitly local: the connector computes the prompt on the decode instance.
        return {**body, "kv_transfer_params": {"do_remote_decode": False, "do_remote_prefill": False}}
