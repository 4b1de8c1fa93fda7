"""One request's way to a decision: tokenize -> hash -> ask the KV store -> let the scheduler decide.

The same plan serves the live path (then forwarded) and /debug/schedule (then only shown), so what
the debug route reports is exactly what a real request would have done. Planning never changes
the load account; the forwarder records the dispatch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass

from kvgate.config.settings import InstanceRole
from kvgate.gateway.chat_inputs import chat_template_inputs
from kvgate.gateway.errors import APIError
from kvgate.gateway.prompt_limit import PromptLimit, prompt_too_long
from kvgate.gateway.protocol import ParsedRequest, add_special_tokens
from kvgate.gateway.registry import InstanceRegistry
from kvgate.gateway.tokenizer import ChatTemplateError, PromptTooLong, TokenizerService
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.base import LookupStatus
from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.decode import DecodeLedger, PDDecision
from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.ttft import TTFTPrediction
from kvgate.scheduler.types import Candidate, Decision, InstanceLoad, InstanceScore

# Hashing more tokens than this moves to the executor (sha256 over ~100K tokens takes milliseconds).
_INLINE_HASH_TOKENS = 16384


@dataclass(frozen=True, slots=True)
class RoutePlan:
    prompt_ids: list[int]
    block_keys: list[str]
    kvs_status: LookupStatus
    kvs_elapsed_s: float
    candidates: tuple[Candidate, ...]
    # The whole-request decision, or the prefill half of a disaggregated one.
    decision: Decision
    # Set when the request goes through prefill/decode disaggregation (docs/PD.md).
    pd: PDDecision | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

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


def split_by_role(candidates: Sequence[Candidate]) -> dict[InstanceRole, tuple[Candidate, ...]]:
    return {role: tuple(c for c in candidates if c.role == role) for role in InstanceRole}


class RoutePlanner:
    def __init__(
        self,
        scheduler: Scheduler,
        kvs: ResilientKVSClient,
        tokenizer: TokenizerService,
        registry: InstanceRegistry,
        account: LoadAccount,
        metrics: GatewayMetrics,
        prompt_limit: PromptLimit,
        executor: Executor | None = None,
        decode_ledger: DecodeLedger | None = None,
    ) -> None:
        self._prompt_limit = prompt_limit
        self._scheduler = scheduler
        self._kvs = kvs
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
        started = time.perf_counter()
        try:
            prompt_ids = await self._prompt_ids(request)
        finally:
            tokenized = time.perf_counter()
            self._stage["tokenize"].observe(tokenized - started)

        started = tokenized
        wants_kvs = self._scheduler.wants_kvs(len(prompt_ids))
        blocks = await self._block_hashes(prompt_ids) if wants_kvs or explain else []
        keys = self._scheduler.block_keys(blocks) if blocks else []
        locations: Sequence[Sequence[str]] | None = None
        disk_locations: Sequence[Sequence[str]] | None = None
        kvs_status: LookupStatus = "skipped"
        kvs_elapsed = 0.0
        if keys and wants_kvs:
            lookup = await self._kvs.lookup(keys, prompt_ids, request.model)
            kvs_status, kvs_elapsed = lookup.status, lookup.elapsed_s
            if lookup.status == "ok":
                locations, disk_locations = lookup.locations, lookup.disk_locations
            self._stage["kvs"].observe(kvs_elapsed)

        # Candidates are read after the lookup's await so the loads are as fresh as possible.
        candidates = tuple(
            Candidate(state.id, state.config.role, self._account.load(state.id))
            for state in self._registry.routable(request.model)
        )
        by_role = split_by_role(candidates)
        pd: PDDecision | None = None
        if self._scheduler.pd_enabled and by_role[InstanceRole.PREFILL] and by_role[InstanceRole.DECODE]:
            candidates = by_role[InstanceRole.PREFILL] + by_role[InstanceRole.DECODE]
            pd = self._scheduler.decide_pd(len(prompt_ids), blocks, locations, by_role[InstanceRole.PREFILL],
                                           by_role[InstanceRole.DECODE], self._decode_ledger.tokens,
                                           now=time.monotonic(), disk_locations=disk_locations, dry_run=explain)
            decision = pd.prefill
        else:
            # Whole requests go to neutral instances only: a decode instance refuses them.
            candidates = by_role[InstanceRole.NEUTRAL]
            if not candidates:
                raise APIError(503, f"no healthy instance serves '{request.model}'", code="no_healthy_instance")
            decision = self._scheduler.decide(len(prompt_ids), blocks, locations, candidates,
                                              disk_locations=disk_locations, dry_run=explain)
        schedule_s = time.perf_counter() - started - kvs_elapsed
        self._stage["schedule"].observe(max(schedule_s, 0.0))
        return RoutePlan(prompt_ids, keys, kvs_status, kvs_elapsed, candidates, decision, pd)

    async def _prompt_ids(self, request: ParsedRequest) -> list[int]:
        # A batched completion is routed on its first prompt, as one engine request. Splitting it
        # would send prompts that usually share a long prefix (few-shot headers, evaluation
        # templates) to different instances, losing the engine's reuse of that prefix inside the
        # batch; and it would make the gateway assemble choice indexes, usage and interleaved
        # stream chunks, and own partial failures, that the engine already handles as one request.
        # The first prompt's prefix hit stands for the batch's; the account counts its miss once
        # per prompt (forwarder.py).
        limit = self._prompt_limit.tokens(request.model)
        param = "messages" if request.messages is not None else "prompt"
        if request.prompt_ids is not None:
            if len(request.prompt_ids) > limit:
                raise prompt_too_long(request.model, len(request.prompt_ids), limit, param)
            return request.prompt_ids
        try:
            special = add_special_tokens(request.body, request.chat)
            if request.messages is not None:
                return await self._tokenizer.encode_chat(request.messages, chat_template_inputs(request.body), special,
                                                         body_bytes=len(request.raw), max_tokens=limit)
            return await self._tokenizer.encode_prompt(request.prompt_text or "", special, max_tokens=limit)
        except ChatTemplateError as exc:
            raise APIError(400, str(exc), param="messages") from None
        except PromptTooLong as exc:
            raise prompt_too_long(request.model, exc.tokens, limit, param) from None

    async def _block_hashes(self, prompt_ids: list[int]) -> list[BlockHash]:
        if len(prompt_ids) <= _INLINE_HASH_TOKENS:
            return self._scheduler.block_hashes(prompt_ids)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._scheduler.block_hashes, prompt_ids)
