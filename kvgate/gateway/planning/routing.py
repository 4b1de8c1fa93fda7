"""One request's way to a decision: tokenize -> hash -> ask the KV store -> let the scheduler decide.

The same plan serves the live path (then forwarded) and /debug/schedule (then only shown), so what
the debug route reports is exactly what a real request would have done. Planning never changes
the load account; the forwarder records the dispatch.

A text prompt may be tokenized only as far as routing needs (prompt_window.py): then `prompt_ids`
are its exact leading ids and `num_prompt_tokens` an estimate (`prompt_tokens_estimated`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

from kvgate.config.settings import InstanceRole
from kvgate.gateway.errors import APIError
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.planning.chat_inputs import chat_template_inputs
from kvgate.gateway.planning.prompt_encoding import PromptEncoding
from kvgate.gateway.planning.prompt_limit import PromptLimit, prompt_too_long
from kvgate.gateway.planning.prompt_window import PromptWindow
from kvgate.gateway.planning.tokenizer import ChatTemplateError, PromptTooLong, TokenizerService
from kvgate.gateway.protocol import ParsedRequest, add_special_tokens
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.base import KVSLookup, LookupStatus
from kvgate.kvs_client.events.view import EventsView
from kvgate.metrics.definitions import GatewayMetrics, KVEventsLookupMetrics
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.decode import DecodeLedger, PDDecision
from kvgate.scheduler.hashing import BlockExtras, BlockHash
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.tiers import EngineHits
from kvgate.scheduler.types import Candidate, Decision, InstanceLoad, InstanceScore, TTFTPrediction

# Hashing more tokens than this moves to the executor (sha256 over ~100K tokens takes milliseconds).
_INLINE_HASH_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class RoutePlan:
    # Exact ids: the whole prompt, or (prompt_tokens_estimated) its leading segments only.
    prompt_ids: list[int]
    block_keys: list[str]
    kvs_status: LookupStatus
    kvs_elapsed_s: float
    candidates: tuple[Candidate, ...]
    # The whole-request decision, or the prefill half of a disaggregated one.
    decision: Decision
    # Set when the request goes through prefill/decode disaggregation (docs/PD.md).
    pd: PDDecision | None = None
    # The prompt's length: len(prompt_ids), or an estimate when prompt_tokens_estimated.
    num_prompt_tokens: int = 0
    prompt_tokens_estimated: bool = False
    # What the engines' KV events said (None: no events index, or not asked for this request).
    engine_hits: EngineHits | None = None
    # The debug route's: each instance's prefix in its own store segment, the store's view alone.
    store_hits: Mapping[str, int] | None = None
    # time.perf_counter() when planning started, and when tokenizing, the lookup (with any further
    # tokenizing it asked for) and the decision ended: the stages' spans (gateway/tracing/).
    stages: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)

    def score(self, instance_id: str) -> InstanceScore | None:
        # Scores are in ranking order and may be built when read: fetch only the one asked for.
        try:
            return self.decision.scores[self.decision.ranking.index(instance_id)]
        except ValueError:
            return None

    def miss_tokens(self, instance_id: str) -> int:
        """Prompt tokens the instance must compute (the whole prompt when it holds nothing)."""
        score = self.score(instance_id)
        return score.prefix_miss_tokens if score is not None else self.num_prompt_tokens

    @property
    def decode_load(self) -> InstanceLoad | None:
        """The load of the instance chosen to decode a disaggregated request (None: the selected one
        decodes too), for the rejection filter."""
        if self.pd is None:
            return None
        return next((c.load for c in self.candidates if c.id == self.pd.decode.selected), None)

    def prediction(self, instance_id: str) -> TTFTPrediction | None:
        predictions = self.decision.predictions
        return predictions[instance_id] if predictions is not None and instance_id in predictions else None


@dataclass(slots=True)
class _Found:
    """What _look_up learnt: the prompt's exact full blocks, their keys, the store's answer and
    the time spent asking it and tokenizing further."""

    blocks: list[BlockHash] = field(default_factory=list)
    keys: list[str] = field(default_factory=list)
    lookup: KVSLookup | None = None
    engine: EngineHits | None = None
    kvs_s: float = 0.0
    extending_s: float = 0.0

    def engine_holds_last(self) -> bool:
        """Whether some engine holds every full block looked up (blocks past them may be hits too)."""
        if self.engine is None or not self.engine.prefixes:
            return False
        looked_up = sum(block.num_tokens for block in self.blocks if block.full)
        return max(prefix.tokens for prefix in self.engine.prefixes.values()) >= looked_up


_ROLES = tuple(InstanceRole)


def split_by_role(candidates: Sequence[Candidate]) -> dict[InstanceRole, tuple[Candidate, ...]]:
    """Every role, with its candidates in their order. One pass over the candidates: filtering them
    once per role (and iterating the enum each request) cost ~3x as much on the request path."""
    groups: dict[InstanceRole, list[Candidate]] = {role: [] for role in _ROLES}
    for candidate in candidates:
        groups[candidate.role].append(candidate)
    return {role: tuple(group) for role, group in groups.items()}


class RoutePlanner:
    def __init__(
        self,
        scheduler: Scheduler,
        kvs: ResilientKVSClient | None,
        tokenizer: TokenizerService,
        registry: InstanceRegistry,
        account: LoadAccount,
        metrics: GatewayMetrics,
        prompt_limit: PromptLimit,
        window: PromptWindow,
        executor: Executor | None = None,
        decode_ledger: DecodeLedger | None = None,
        events: EventsView | None = None,
        events_metrics: KVEventsLookupMetrics | None = None,
        max_query_blocks: int = 1024,
    ) -> None:
        """`kvs` None: no store (--kvs-backend kv_events); `events`: the engines' KV events index."""
        self.prompt_limit = prompt_limit
        self._window = window
        self._scheduler = scheduler
        self._kvs = kvs
        self._events = events
        self._unmatched = events_metrics.unmatched if events_metrics is not None else None
        self._max_query_blocks = kvs.max_query_blocks if kvs is not None else max_query_blocks
        self._tokenizer = tokenizer
        self._registry = registry
        self._account = account
        self._executor = executor
        self._decode_ledger = decode_ledger if decode_ledger is not None else DecodeLedger()
        self._stage = {stage: metrics.stage_seconds.labels(stage) for stage in ("tokenize", "kvs", "schedule")}

    async def plan(self, request: ParsedRequest, explain: bool = False) -> RoutePlan:
        """The decision for `request`. Block keys are computed only when the store will be asked,
        unless `explain` (the debug route shows them always)."""
        if not self._registry.serves(request.model):
            raise APIError(404, f"the model '{request.model}' does not exist; see GET /v1/models",
                           param="model", code="model_not_found")
        planning = time.perf_counter()
        try:
            encoding = await self._encoding(request)
        except BaseException:
            self._stage["tokenize"].observe(time.perf_counter() - planning)
            raise
        started = time.perf_counter()
        tokenize_s = started - planning  # observed with any extension's time below

        extras = self._extras(request)
        # Keys the engines mix an adapter or a salt into cannot be matched by an algorithm without that slot.
        matchable = not extras or self._scheduler.extras_hashable
        if not matchable and self._unmatched is not None:
            self._unmatched.labels("lora" if extras.lora else "cache_salt").inc()
        wants_kvs = matchable and self._scheduler.wants_kvs(encoding.total_tokens)
        found = await self._look_up(request, encoding, wants_kvs, explain and matchable, extras)
        looked_up = time.perf_counter()
        self._stage["tokenize"].observe(tokenize_s + found.extending_s)
        lookup = found.lookup
        locations: Sequence[Sequence[str]] | None = None
        disk_locations: Sequence[Sequence[str]] | None = None
        kvs_status: LookupStatus = "skipped" if lookup is None else lookup.status
        if lookup is not None:
            if lookup.status == "ok":
                locations, disk_locations = lookup.locations, lookup.disk_locations
            self._stage["kvs"].observe(found.kvs_s)
        blocks, keys, kvs_elapsed = found.blocks, found.keys, found.kvs_s

        num_prompt_tokens = encoding.total_tokens
        # Candidates are read after the lookup's await so the loads are as fresh as possible.
        load = self._account.load
        by_role = split_by_role([Candidate(state.id, state.config.role, load(state.id))
                                 for state in self._registry.routable(request.model)])
        pd: PDDecision | None = None
        if self._scheduler.pd_enabled and by_role[InstanceRole.PREFILL] and by_role[InstanceRole.DECODE]:
            candidates = by_role[InstanceRole.PREFILL] + by_role[InstanceRole.DECODE]
            pd = self._scheduler.decide_pd(num_prompt_tokens, blocks, locations, by_role[InstanceRole.PREFILL],
                                           by_role[InstanceRole.DECODE], self._decode_ledger.tokens,
                                           now=time.monotonic(), disk_locations=disk_locations, engine=found.engine,
                                           dry_run=explain)
            decision = pd.prefill
        else:
            # Whole requests go to neutral instances only: a decode instance refuses them.
            candidates = by_role[InstanceRole.NEUTRAL]
            if not candidates:
                raise APIError(503, f"no healthy instance serves '{request.model}'", code="no_healthy_instance")
            decision = self._scheduler.decide(num_prompt_tokens, blocks, locations, candidates,
                                              disk_locations=disk_locations, engine=found.engine, dry_run=explain)
        decided = time.perf_counter()
        schedule_s = decided - started - kvs_elapsed - found.extending_s
        self._stage["schedule"].observe(max(schedule_s, 0.0))
        if not encoding.complete and not explain:  # the debug route only looks
            self._window.metrics.estimated_prompts.inc()
            self._window.complete_later(self._tokenizer, encoding)
        store_hits = self._scheduler.store_hits(num_prompt_tokens, blocks, locations) if explain else None
        return RoutePlan(encoding.ids, keys, kvs_status, kvs_elapsed, candidates, decision, pd,
                         num_prompt_tokens, not encoding.complete, found.engine, store_hits,
                         (planning, started, looked_up, decided))

    async def _look_up(self, request: ParsedRequest, encoding: PromptEncoding, wants_kvs: bool,
                       explain: bool, extras: BlockExtras | None) -> _Found:
        """Hash the exact full blocks and ask the store (when it can change the decision; the
        debug route hashes always). While the store holds the last block asked of a partial
        prompt, tokenize a window twice the last one and ask again."""
        found = _Found()
        window = self._window.first_window(request) or 0  # a partial prompt had a first window
        while True:
            hashable = self._window.hashable_ids(encoding)
            if wants_kvs or explain:
                # Hashed inline when short (no coroutine to build and await on the common path).
                found.blocks = (self._scheduler.block_hashes(hashable, extras) if len(hashable) <= _INLINE_HASH_TOKENS
                                else await self._hash_in_executor(hashable, extras))
                found.keys = self._scheduler.block_keys(found.blocks) if found.blocks else []
            if found.keys and wants_kvs and self._kvs is not None:
                found.lookup = await self._kvs.lookup(found.keys, hashable, self._base_model(request.model))
                found.kvs_s += found.lookup.elapsed_s
            if self._events is not None and (wants_kvs or explain):
                found.engine = self._events.hits(found.blocks[: self._max_query_blocks])
            if not (wants_kvs and (self._window.should_extend(encoding, found.keys, found.lookup,
                                                              self._max_query_blocks)
                                   or (not encoding.complete and len(found.keys) < self._max_query_blocks
                                       and found.engine_holds_last()))):
                return found
            # The store knows more of this prompt than the tokenize cache: tokenize further.
            window *= 2
            extending = time.perf_counter()
            await self._tokenizer.extend(encoding, window)
            found.extending_s += time.perf_counter() - extending
            self._window.metrics.extensions.inc()

    def _extras(self, request: ParsedRequest) -> BlockExtras | None:
        """What the engine mixes into this request's block hashes beside its tokens: the LoRA adapter
        its model names, its cache salt (vLLM's `cache_salt`; a non-string one the engine refuses)."""
        adapter = self._registry.lora_adapter(request.model)
        salt = request.body.get("cache_salt")
        salt = salt if isinstance(salt, str) and salt else None
        if adapter is None and salt is None:
            return None
        return BlockExtras((adapter.name, adapter.path) if adapter is not None else None, salt)

    def _base_model(self, model: str) -> str:
        """The model whose engines serve `model`: itself, or the base of the LoRA adapter it names."""
        adapter = self._registry.lora_adapter(model)
        return adapter.base_model if adapter is not None else model

    async def _encoding(self, request: ParsedRequest) -> PromptEncoding:
        # A batched completion is routed on its first prompt, as one engine request. Splitting it
        # would send prompts that usually share a long prefix (few-shot headers, evaluation
        # templates) to different instances, losing the engine's reuse of that prefix inside the
        # batch; and it would make the gateway assemble choice indexes, usage and interleaved
        # stream chunks, and own partial failures, that the engine already handles as one request.
        # The first prompt's prefix hit stands for the batch's; the account counts its miss once
        # per prompt (forwarder.py).
        limit = self.prompt_limit.tokens(self._base_model(request.model))
        param = "messages" if request.messages is not None else "prompt"
        if request.prompt_ids is not None:
            if len(request.prompt_ids) > limit:
                raise prompt_too_long(request.model, len(request.prompt_ids), limit, param)
            return PromptEncoding.exact(request.prompt_ids)
        window = self._window.first_window(request)
        try:
            special = add_special_tokens(request.body, request.chat)
            if request.messages is not None:
                return await self._tokenizer.start_chat(request.messages, chat_template_inputs(request.body), special,
                                                        body_bytes=len(request.raw), max_tokens=limit,
                                                        window_tokens=window)
            return await self._tokenizer.start_prompt(request.prompt_text or "", special, max_tokens=limit,
                                                      window_tokens=window)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except PromptTooLong as exc:
            raise prompt_too_long(request.model, exc.tokens, limit, param) from None

    async def _hash_in_executor(self, prompt_ids: Sequence[int], extras: BlockExtras | None) -> list[BlockHash]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._scheduler.block_hashes, prompt_ids, extras)
