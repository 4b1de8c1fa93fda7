"""The mock engine's HTTP face: an OpenAI-compatible server in front of an EngineLoop.

Routes as a vLLM instance serves them: /v1/completions and /v1/chat/completions (streaming and
not), /v1/models, /health, /metrics, /tokenize and /reset_prefix_cache. A client that disconnects
cancels its request in the engine (aiohttp cancels the handler; its `finally` frees the slot).
With KV events on, every change of the prefix cache is also published as vLLM publishes it
(kv_events.py).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.config.settings import Settings
from kvgate.engine_model import EngineCore, EngineRequest, ServiceProfile
from kvgate.engine_model.store import StoreProfile
from kvgate.gateway.errors import APIError, error_middleware
from kvgate.gateway.planning.chat_inputs import chat_template_inputs
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.gateway.protocol import ParsedRequest, add_special_tokens, json_response
from kvgate.mock_engine.block_keys import BlockKeyer
from kvgate.mock_engine.engine_loop import EngineLoop, RequestStream
from kvgate.mock_engine.generation import generated_token_ids, generated_words
from kvgate.mock_engine.kv_event_blocks import BlockEventTranslator
from kvgate.mock_engine.kv_event_wire import KVEvent
from kvgate.mock_engine.kv_events import KVEventsOptions, KVEventsPublisher
from kvgate.mock_engine.metrics import EngineMetrics
from kvgate.mock_engine.openai_request import GenerationRequest, parse_generation, parse_served
from kvgate.mock_engine.pd import Exchange, PDEngineRole, PDRole
from kvgate.mock_engine.publication import BlockPublisher, PublicationQueue
from kvgate.mock_engine.responses import SSE_DONE, ResponseShape, sse, usage
from kvgate.mock_engine.store_segment import StoreSegment
from kvgate.scheduler.key_formats import make_key_format

DEFAULT_MODEL = "kvgate/mock-llm"
_MAX_BODY_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class MockEngineConfig:
    """What makes one mock engine: its name, its GPU profile, its clock and its hashing."""

    model: str = DEFAULT_MODEL
    seed: int = 0
    # Real seconds per modelled GPU second: 0.1 runs ten times faster than the modelled GPU.
    time_scale: float = 1.0
    profile: ServiceProfile = field(default_factory=ServiceProfile)
    # Longest prompt + max_tokens accepted; 0 means the KV capacity.
    max_model_len: int = 0
    # Hash algorithm, chunk size (= block size), seed and key format: the gateway's, so keys match.
    settings: Settings = field(default_factory=Settings)
    # usage.prompt_tokens_details.cached_tokens in answers, as vLLM with --enable-prompt-tokens-details.
    report_cached_tokens: bool = True
    # A prefill or decode engine of a disaggregated fleet (mock_engine/pd.py); None: a whole engine.
    pd: PDRole | None = None
    # Publish the prefix cache's changes as vLLM's KV events (ZMQ); None: no events.
    kv_events: KVEventsOptions | None = None
    # Blocks of the engine's own DRAM segment of the KV store behind HBM (store_segment.py); 0: none,
    # the store index then lists exactly what HBM holds.
    store_segment_blocks: int = 0

    def __post_init__(self) -> None:
        if self.profile.block_size != self.settings.kvs_chunk_size:
            raise ValueError(
                f"the engine's block size ({self.profile.block_size}) must equal --kvs-chunk-size "
                f"({self.settings.kvs_chunk_size}), or the gateway's keys never match the engine's blocks"
            )
        if self.time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        if self.store_segment_blocks < 0:
            raise ValueError("store_segment_blocks must be >= 0")
        make_key_format(self.settings)  # raises ValueError naming a bad --kvs-key-format

    @property
    def context_limit(self) -> int:
        return self.max_model_len or self.profile.cache_capacity_blocks * self.profile.block_size


class MockEngine:
    """One simulated vLLM instance: engine loop, tokenizer, key hashing, publication, metrics."""

    def __init__(
        self,
        config: MockEngineConfig,
        tokenizer: TokenizerService | None,
        publisher: BlockPublisher | None,
        name: str = "mock-engine",
    ) -> None:
        self.config = config
        self._tokenizer = tokenizer
        self._keyer = BlockKeyer(config.settings)
        self.publication = PublicationQueue(publisher, name) if publisher is not None else None
        events = config.kv_events
        self.kv_events = KVEventsPublisher(events) if events is not None else None
        self._block_events: BlockEventTranslator | None = None
        if events is not None:
            self._block_events = BlockEventTranslator(config.profile.block_size, events.hash_format)
        self.segment: StoreSegment | None = None
        if config.store_segment_blocks:
            s = config.settings
            self.segment = StoreSegment(
                config.store_segment_blocks, config.profile.block_size,
                StoreProfile(s.kv_bytes_per_token, s.kv_host_bandwidth_gb_s * 1e9, s.kv_network_bandwidth_gb_s * 1e9),
                self.publication.on_cache_change if self.publication is not None else None,
                self._on_loaded if events is not None else None,
            )
        segment = self.segment
        watched = self.publication is not None or events is not None or segment is not None
        on_change = self._on_cache_change if watched else None
        self.core = EngineCore(config.profile, on_cache_change=on_change,
                               store_loader=segment.load if segment else None,
                               store_writer=segment.write_back if segment else None)
        # A step's events go out once it is over (vLLM publishes after the step ran), not when planned.
        self._step_events: list[KVEvent] = []
        self.loop = EngineLoop(self.core, config.time_scale,
                               on_step_done=self._flush_events if events is not None else None)
        self.metrics = EngineMetrics(config.model, self.core.stats,
                                     flavour=config.pd.protocol if config.pd is not None else "vllm")
        self._created = int(time.time())
        self.pd = PDEngineRole(config.pd, name, config.time_scale) if config.pd is not None else None
        # The last bodies received, as sent: what a router really asked this engine.
        self.received: deque[dict[str, Any]] = deque(maxlen=64)
        self.url = ""  # set once the server is bound

    def app(self) -> web.Application:
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[error_middleware])
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/reset_prefix_cache", self._reset_prefix_cache)
        if self.pd is not None:
            self.pd.add_routes(app)
        return app

    async def start(self) -> None:
        if self.kv_events is not None:
            self.kv_events.start()  # first: a taken address fails the start before anything runs
        if self.publication is not None:
            self.publication.start()
        self.loop.start()

    async def close(self) -> None:
        await self.loop.close()
        if self.pd is not None:
            await self.pd.close()
        if self.publication is not None:
            await self.publication.close()
        if self.kv_events is not None:
            await self.kv_events.close()

    # --- the prefix cache's changes, to the store index and the KV events ---

    def _on_cache_change(self, added: list[str], evicted: list[str]) -> None:
        """The core's callback, inside a step: the store index now, the events when the step ends.
        With a store segment, HBM's evictions stay in the segment and the index follows the segment."""
        if self.segment is not None:
            self.segment.computed(added)
        elif self.publication is not None:
            self.publication.on_cache_change(added, evicted)
        if self._block_events is not None:
            self._step_events += self._block_events.changes(added, evicted)

    def _on_loaded(self, keys: list[str]) -> None:
        """Blocks the store segment loaded into HBM: stored blocks to the events, as vLLM reports
        blocks a KV connector loaded."""
        if self._block_events is not None:
            self._step_events += self._block_events.changes(keys, [])

    def _flush_events(self) -> None:
        """Publish the finished step's events as one batch."""
        if self.kv_events is not None and self._step_events:
            events, self._step_events = self._step_events, []
            self.kv_events.publish(events)

    def _publish_events(self, events: list[KVEvent]) -> None:
        """Changes made outside a step: after the events of a step still running, as one batch."""
        if self.kv_events is not None:
            self._step_events += events
            self._flush_events()

    def _hold_blocks(
        self, token_ids: Sequence[int], output_ids: Sequence[int] = ()
    ) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The keys of the prompt's full blocks and of the full blocks its output fills after them;
        with KV events, all described for the events until `_release_keys` (call it with both
        once the request has left the engine)."""
        tokens = [*token_ids, *output_ids] if output_ids else token_ids
        if self._block_events is None:
            keys = self._keyer.keys(tokens)
        else:
            keys, vllm_hashes = self._keyer.keys_and_vllm_hashes(tokens)
            self._block_events.hold(keys, vllm_hashes, tokens)
        prompt_blocks = len(token_ids) // self.config.profile.block_size
        return keys[:prompt_blocks], keys[prompt_blocks:]

    def _release_keys(self, keys: tuple[str, ...]) -> None:
        if self._block_events is not None:
            self._block_events.release(keys)

    # --- routes ---

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _models(self, request: web.Request) -> web.Response:
        card = {
            "id": self.config.model,
            "object": "model",
            "created": self._created,
            "owned_by": "kvgate",
            "root": self.config.model,
            "max_model_len": self.config.context_limit,
        }
        return json_response({"object": "list", "data": [card]})

    async def _reset_prefix_cache(self, request: web.Request) -> web.Response:
        """vLLM's POST /reset_prefix_cache: drops every cached block, and fails (`success` false)
        while running requests hold blocks, as vLLM's does."""
        dropped = self.core.cache.clear()
        if dropped is None:
            return json_response({"success": False})
        if self.publication is not None and self.segment is None:  # a segment keeps its blocks
            self.publication.on_cache_change([], dropped)
        if self._block_events is not None:
            self._publish_events(self._block_events.cleared())
        return json_response({"success": True})

    async def _metrics(self, request: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _tokenize(self, request: web.Request) -> web.Response:
        """vLLM's POST /tokenize (a `prompt` or chat `messages`): routers such as vllm-router's
        cache_aware policy ask the workers for token ids instead of tokenizing themselves."""
        raw = await request.read()
        try:
            chat = "messages" in orjson.loads(raw)
        except (orjson.JSONDecodeError, TypeError):
            chat = False  # the parser below words the error
        tokens = list(await self._prompt_token_ids(parse_served(raw, chat, self.config.model)))
        return json_response(
            {
                "count": len(tokens),
                "max_model_len": self.config.context_limit,
                "tokens": tokens,
                "token_strs": None,
            }
        )

    # --- one request ---

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        arrived = time.monotonic()
        generation = parse_generation(await request.read(), chat, self.config.model)
        self.received.append(generation.parsed.body)
        prompts = await self._prompts_token_ids(generation.parsed)
        max_tokens = generation.max_tokens
        for token_ids in prompts:
            self._check_length(len(token_ids), max_tokens)
        exchange = await self._hand_off(generation, prompts)
        if exchange.handle is not None and self.pd is not None and self.pd.role.protocol == "sglang":
            max_tokens = 1  # an SGLang prefill server computes the prompt and its first token only
        request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        # As vLLM: one engine request per prompt of a batch; its n samples share the prompt's prefill.
        engine_ids = [request_id if len(prompts) == 1 else f"{request_id}-{i}" for i in range(len(prompts))]
        held: list[tuple[str, ...]] = []
        try:
            streams = []
            for engine_id, token_ids in zip(engine_ids, prompts, strict=True):
                # The KV of every generated token but the last is computed, and its full blocks cached
                # (as vLLM). n samples share one sequence here: their output blocks are not modelled.
                output_ids = (generated_token_ids(self.config.seed, token_ids, max_tokens - 1)
                              if generation.n == 1 else ())
                request_blocks, output_blocks = self._hold_blocks(token_ids, output_ids)
                held.append(request_blocks + output_blocks)
                streams.append(self.loop.submit(
                    EngineRequest(engine_id, request_blocks, len(token_ids), max_tokens, output_blocks)))
            shape = ResponseShape(chat, request_id, self.config.model, int(time.time()))
            # Choice index = prompt index * n + sample index, as vLLM numbers a batch's choices.
            words = [generated_words(self.config.seed + sample, token_ids, max_tokens)
                     for token_ids in prompts for sample in range(generation.n)]
            prompt_tokens = sum(len(token_ids) for token_ids in prompts)
            if generation.parsed.stream:
                response = await self._stream(request, streams, shape, words, prompt_tokens, generation, arrived,
                                              exchange)
            else:
                response = await self._whole(streams, shape, words, prompt_tokens, generation.n, arrived, exchange)
            if self.pd is not None:
                self.pd.offer(exchange, self._keyer.keys(prompts[0]), prompt_tokens)
            return response
        except ValueError as exc:  # a prompt can never fit this engine's KV cache
            raise APIError(400, str(exc), param="prompt") from None
        finally:
            # Finished requests are already gone; anything else (disconnect, error) frees the engine.
            for engine_id in engine_ids:
                self.loop.cancel(engine_id)
            for keys in held:
                self._release_keys(keys)

    async def _hand_off(self, generation: GenerationRequest, prompts: list[Sequence[int]]) -> Exchange:
        """Prefill: where its blocks will be offered. Decode: pulls the prompt's blocks from the
        prefill engine into this engine's cache first."""
        if self.pd is None:
            return Exchange()
        if len(prompts) != 1 or generation.n != 1:
            raise APIError(400, f"{self.pd.role.role} instance: one prompt and n=1 per request")
        body = generation.parsed.body
        if self.pd.role.role == "prefill":
            return self.pd.prefill_exchange(body, self.url)
        exchange = await self.pd.receive(body, len(prompts[0]))
        if exchange.received is not None:
            block_keys, _ = self._hold_blocks(prompts[0])
            try:
                if exchange.received.block_keys != block_keys:
                    raise APIError(400, "decode instance: the KV received is not this prompt's")
                self._receive_blocks(block_keys)
            finally:
                self._release_keys(block_keys)
        return exchange

    def _receive_blocks(self, block_keys: tuple[str, ...]) -> None:
        """Pulled KV enters the cache; KV events report it as vLLM reports blocks a connector loaded."""
        cache = self.core.cache
        new = [key for key in block_keys if key not in cache]
        evicted = cache.insert(block_keys)
        # A block inserted and evicted again by this very insert (a tiny cache) was never there.
        fresh = set(new)
        if self._block_events is not None:
            self._publish_events(self._block_events.changes(
                [key for key in new if key in cache], [key for key in evicted if key not in fresh]))

    async def _prompts_token_ids(self, parsed: ParsedRequest) -> list[Sequence[int]]:
        """The token ids of every prompt: one, or each of a batched completion's."""
        if parsed.batch is None:
            return [await self._prompt_token_ids(parsed)]
        if isinstance(parsed.batch[0], str):
            special = add_special_tokens(parsed.body, chat=False)
            return [await self._encode_text(text, special) for text in parsed.batch]  # type: ignore[arg-type]
        return list(parsed.batch)  # type: ignore[arg-type]

    async def _prompt_token_ids(self, parsed: ParsedRequest) -> Sequence[int]:
        if parsed.prompt_ids is not None:
            return parsed.prompt_ids
        special = add_special_tokens(parsed.body, parsed.chat)
        if parsed.messages is None:
            return await self._encode_text(parsed.prompt_text or "", special)
        tokenizer = self._require_tokenizer()
        try:
            return await tokenizer.encode_chat(parsed.messages, chat_template_inputs(parsed.body), special,
                                              body_bytes=len(parsed.raw))
        except ValueError as exc:  # chat template errors: roles or content the template refuses
            raise APIError(400, str(exc), param="messages") from None

    async def _encode_text(self, text: str, add_special: bool) -> Sequence[int]:
        return await self._require_tokenizer().encode_prompt(text, add_special)

    def _require_tokenizer(self) -> TokenizerService:
        if self._tokenizer is None:
            raise APIError(
                400,
                "this engine was started without a tokenizer: send token ids as the prompt",
                param="prompt",
            )
        return self._tokenizer

    def _check_length(self, prompt_tokens: int, max_tokens: int) -> None:
        limit = self.config.context_limit
        if prompt_tokens + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                param="max_tokens",
            )

    async def _events(
        self, stream: RequestStream, arrived: float, on_tokens: Callable[[int, int, bool], Awaitable[None]]
    ) -> int:
        """Feed each event's new tokens to `on_tokens(start, count, finished)`; returns cached tokens."""
        produced = 0
        while True:
            event = await stream.next_event()
            if produced == 0:
                self.metrics.observe_ttft(time.monotonic() - arrived)
            await on_tokens(produced, event.num_tokens, event.finished)
            produced += event.num_tokens
            if event.finished:
                return event.cached_tokens

    async def _stream(
        self,
        request: web.Request,
        streams: list[RequestStream],
        shape: ResponseShape,
        words: list[list[str]],
        prompt_tokens: int,
        generation: GenerationRequest,
        arrived: float,
        exchange: Exchange,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        n = generation.n

        def sender(prompt_index: int) -> Callable[[int, int, bool], Awaitable[None]]:
            async def send(start: int, count: int, finished: bool) -> None:
                for index in range(prompt_index * n, prompt_index * n + n):
                    # As vLLM: the chat role chunk goes out with the first token, once prefill is done.
                    opener = shape.first_chunk(index) if start == 0 else None
                    if opener is not None:
                        await response.write(sse(opener))
                    text = "".join(words[index][start : start + count])
                    await response.write(sse(shape.text_chunk(text, "length" if finished else None, index)))

            return send

        # The prompts of a batch progress together; their chunks interleave, each naming its choice.
        cached = await asyncio.gather(*(self._events(stream, arrived, sender(i)) for i, stream in enumerate(streams)))
        exchange.cached_tokens = sum(cached)
        if generation.include_usage:
            completion_tokens = sum(len(choice) for choice in words)
            reported = exchange.reported_cached_tokens() if self.config.report_cached_tokens else None
            await response.write(sse(shape.usage_chunk(usage(prompt_tokens, completion_tokens, reported))))
        await response.write(SSE_DONE)
        await response.write_eof()
        return response

    async def _whole(
        self,
        streams: list[RequestStream],
        shape: ResponseShape,
        words: list[list[str]],
        prompt_tokens: int,
        n: int,
        arrived: float,
        exchange: Exchange,
    ) -> web.Response:
        async def ignore(start: int, count: int, finished: bool) -> None:
            return None

        cached = await asyncio.gather(*(self._events(stream, arrived, ignore) for stream in streams))
        exchange.cached_tokens = sum(cached)
        completion_tokens = sum(len(choice) for choice in words)
        reported = exchange.reported_cached_tokens() if self.config.report_cached_tokens else None
        body = shape.whole(["".join(choice) for choice in words], "length",
                           usage(prompt_tokens, completion_tokens, reported))
        return json_response({**body, **exchange.answer_fields})


@dataclass
class MockEngineHandle:
    url: str
    engine: MockEngine
    _runner: web.AppRunner
    _closed: bool = False

    async def close(self) -> None:
        """Stop serving, then stop the engine and withdraw its blocks; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        await self._runner.cleanup()
        await self.engine.close()


async def start_mock_engine(
    config: MockEngineConfig | None = None,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    tokenizer: TokenizerService | None = None,
    publisher: BlockPublisher | None = None,
    name: str = "mock-engine",
) -> MockEngineHandle:
    """Serve a mock engine on host:port (0 = a free port) in the running event loop."""
    engine = MockEngine(config or MockEngineConfig(), tokenizer, publisher, name)
    await engine.start()
    # handler_cancellation: a client that goes away cancels its handler, hence its engine request.
    runner = web.AppRunner(engine.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        await engine.close()
        raise
    bound_port = runner.addresses[0][1]
    engine.url = f"http://{host}:{bound_port}"
    if engine.config.pd is not None and engine.config.pd.bootstrap_port:
        # The prefill engine's bootstrap server (SGLang, Mooncake connector): the same routes.
        try:
            await web.TCPSite(runner, host, engine.config.pd.bootstrap_port).start()
        except OSError:
            await runner.cleanup()
            await engine.close()
            raise
    return MockEngineHandle(engine.url, engine, runner)
