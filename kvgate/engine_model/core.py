"""A continuous-batching engine with chunked prefill and a prefix cache, as a pure state machine.

The caller owns time: `submit(req, now)`, then `step(now)` repeatedly; a step starts at `now` and
lasts `outcome.duration_s`, after which the caller may step again. The mock engine sleeps through
steps in real time; the simulator jumps over them in virtual time. Nothing here is random.

One step, as vLLM's scheduler does it:
1. admit waiting requests in arrival order while a running slot and KV memory are free; the prefix
   is matched *now*, so a request that waited behind one with the same prefix reuses its blocks;
2. give every running decode one token, then share the remaining token budget between prefills
   (each first gets `prefill_share_tokens`, the rest goes in arrival order);
3. price the batch with the profile; blocks whose prefill completed enter the cache.

Simplifications, stated: a request reserves the KV memory for its whole prompt and `max_tokens`
at admission (no preemption); full prompt blocks are cached, and blocks filled by generated tokens
only when the request names them (`output_block_keys`: the mock engine does, the trace simulator
cannot); a fully cached prompt still computes its last token (as vLLM does, to produce logits).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvgate.engine_model.cache import BlockCache
from kvgate.engine_model.profile import ServiceProfile
from kvgate.engine_model.store import StoreLoad

CacheChangeCallback = Callable[[list[str], list[str]], None]
# Given the keys after the HBM hit, how many leading ones the shared store can load, and how fast.
StoreLoader = Callable[[tuple[str, ...]], StoreLoad]
# Given the keys of an HBM hit at admission: the store connector writes back those the store lost.
StoreWriter = Callable[[tuple[str, ...]], None]


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    # Keys of the prompt's *full* blocks, in order (what the gateway's hasher computes).
    block_keys: tuple[str, ...]
    num_prompt_tokens: int
    max_tokens: int
    # Keys of the full blocks after the prompt's, which generated tokens fill (the prompt's unfull
    # tail, then output), in order. Each enters the cache once its last token's KV is computed
    # (the step after that token is generated), as vLLM caches decode blocks.
    output_block_keys: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 1 or self.max_tokens < 1:
            raise ValueError("num_prompt_tokens and max_tokens must be >= 1")


@dataclass(slots=True)
class StepOutcome:
    duration_s: float = 0.0
    # (request id, seconds it waited between submit and admission) for requests admitted this step.
    admitted: list[tuple[str, float]] = field(default_factory=list)
    # Request id -> prompt tokens found in the prefix cache, for requests admitted this step
    # (what vLLM reports per request as usage.prompt_tokens_details.cached_tokens).
    cached_tokens: dict[str, int] = field(default_factory=dict)
    # Prefill finished this step: the first token is out at now + duration_s.
    first_tokens: list[str] = field(default_factory=list)
    # Got decode tokens this step (num_steps tokens each when fast-forwarded).
    tokens: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    prefill_tokens_computed: int = 0
    # Prompt tokens loaded from the shared store at admission (own segment, other segments).
    loaded_own_tokens: int = 0
    loaded_remote_tokens: int = 0
    # More than 1 only when step() was allowed to fast-forward through decode-only steps.
    num_steps: int = 1


@dataclass(frozen=True, slots=True)
class CoreStats:
    num_running: int
    num_waiting: int
    kv_cache_usage_ratio: float
    # Prompt tokens looked up in / found in the prefix cache at admission (vLLM's counters).
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_cached_blocks: int


class _Sequence:
    """A request's progress inside the engine."""

    __slots__ = (
        "request_id",
        "keys",
        "prompt",
        "max_tokens",
        "blocks_needed",
        "submitted_at",
        "computed",
        "generated",
        "pinned",
        "reserved",
        "out_keys",
        "out_pinned",
    )

    def __init__(self, req: EngineRequest, blocks_needed: int, now: float) -> None:
        self.request_id = req.request_id
        self.keys = req.block_keys
        self.prompt = req.num_prompt_tokens
        self.max_tokens = req.max_tokens
        self.blocks_needed = blocks_needed
        self.submitted_at = now
        self.computed = 0  # prompt tokens in KV (cached or computed)
        self.generated = 0
        self.pinned = 0  # leading keys this request holds pinned in the cache
        self.reserved = 0  # blocks of KV memory reserved and not yet committed
        self.out_keys = req.output_block_keys
        self.out_pinned = 0  # leading output keys committed and pinned


def _copy_sequence(seq: _Sequence) -> _Sequence:
    clone = object.__new__(_Sequence)
    for name in _Sequence.__slots__:
        setattr(clone, name, getattr(seq, name))
    return clone


class EngineCore:
    def __init__(
        self,
        profile: ServiceProfile,
        on_cache_change: CacheChangeCallback | None = None,
        store_loader: StoreLoader | None = None,
        store_writer: StoreWriter | None = None,
    ) -> None:
        self.profile = profile
        # With a shared store, prefix blocks missing from HBM are loaded at admission when the
        # store holds them (the copy time is added to that step), instead of being computed.
        self._store_loader = store_loader
        self._store_writer = store_writer
        self.cache = BlockCache(profile.cache_capacity_blocks)
        self._on_cache_change = on_cache_change
        self._waiting: deque[_Sequence] = deque()
        self._running: list[_Sequence] = []
        self._ids: set[str] = set()
        self._uncomputed = 0
        self._load_s = 0.0  # store copies of requests admitted this step, charged to its duration
        self._queries = 0
        self._hits = 0

    # --- requests in and out ---

    def submit(self, req: EngineRequest, now: float) -> None:
        """Queue a request; raises ValueError if it is malformed or can never fit this engine."""
        bs = self.profile.block_size
        if req.request_id in self._ids:
            raise ValueError(f"request id {req.request_id!r} already in the engine")
        if len(req.block_keys) > req.num_prompt_tokens // bs:
            raise ValueError(
                f"{len(req.block_keys)} block keys for {req.num_prompt_tokens} tokens of {bs}-token blocks"
            )
        if req.output_block_keys and len(req.block_keys) != req.num_prompt_tokens // bs:
            raise ValueError("output block keys follow the keys of every full prompt block")
        capacity = self.profile.cache_capacity_blocks
        if -(-(req.num_prompt_tokens + 1) // bs) > capacity:
            raise ValueError(
                f"prompt of {req.num_prompt_tokens} tokens exceeds the KV capacity ({capacity * bs} tokens)"
            )
        # Memory for the prompt and every token it may generate, capped so a long answer still runs alone.
        blocks_needed = min(-(-(req.num_prompt_tokens + req.max_tokens) // bs), capacity)
        self._waiting.append(_Sequence(req, blocks_needed, now))
        self._ids.add(req.request_id)
        self._uncomputed += req.num_prompt_tokens

    def cancel(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its slot, pins and reserved memory."""
        if request_id not in self._ids:
            return False
        self._ids.discard(request_id)
        for seq in self._waiting:
            if seq.request_id == request_id:
                self._waiting.remove(seq)
                self._uncomputed -= seq.prompt
                return True
        for seq in self._running:
            if seq.request_id == request_id:
                self._running.remove(seq)
                self._uncomputed -= seq.prompt - seq.computed
                self._free(seq)
                return True
        raise AssertionError(f"request {request_id!r} tracked but neither waiting nor running")

    # --- observation ---

    def forecast_ttft(self, req: EngineRequest, now: float, free_at: float, store_loader: StoreLoader | None) -> float:
        """Seconds from `now` to `req`'s first token if it were submitted now and nothing else
        arrived, the engine's next step starting at `free_at`. Runs a copy (no callbacks, the given
        pure `store_loader`): the engine itself is not touched."""
        copy = EngineCore(self.profile, None, store_loader)
        copy.cache = self.cache.copy()
        copy._waiting = deque(_copy_sequence(seq) for seq in self._waiting)
        copy._running = [_copy_sequence(seq) for seq in self._running]
        copy._ids = set(self._ids)
        copy._uncomputed = self._uncomputed
        copy._load_s = self._load_s
        copy.submit(req, now)
        at = free_at
        while True:
            out = copy.step(at)
            at += out.duration_s
            if req.request_id in out.first_tokens:
                return at - now

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def uncomputed_prefill_tokens(self) -> int:
        """Prompt tokens still to prefill: waiting prompts in full, running prefills' remainders."""
        return self._uncomputed

    def stats(self) -> CoreStats:
        return CoreStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_cache_usage_ratio=self.cache.used_blocks / self.cache.capacity_blocks,
            prefix_cache_queries=self._queries,
            prefix_cache_hits=self._hits,
            num_cached_blocks=len(self.cache),
        )

    # --- the step ---

    def step(self, now: float, fast_forward_until: float | None = None) -> StepOutcome:
        """Run one engine step starting at `now`.

        With `fast_forward_until`, a batch of pure decodes runs as many steps as start before that
        time (at least one) or until a request finishes, whichever is first, in one call: nothing
        can change in between, so the result equals stepping one by one.
        """
        out = StepOutcome()
        evicted = self._admit(now, out)
        profile = self.profile
        bs = profile.block_size
        decodes = []
        prefills = []
        for seq in self._running:
            (decodes if seq.computed >= seq.prompt else prefills).append(seq)
        if not decodes and not prefills:
            out.num_steps = 0
            self._publish([], evicted)
            return out
        if not prefills and fast_forward_until is not None:
            added = self._fast_forward(now, fast_forward_until, decodes, out)
            self._publish(added, evicted)
            return out

        duration = profile.step_overhead_s + self._load_s
        self._load_s = 0.0
        if decodes:
            context = 0
            for seq in decodes:
                context += seq.prompt + seq.generated
            duration += profile.decode.step_s(len(decodes), context)
        chunks = self._plan_prefill(prefills, max(0, profile.max_batch_tokens - len(decodes)))
        prefill_cost = profile.prefill.chunk_s
        added: list[str] = []
        for seq, new in chunks:
            duration += prefill_cost(seq.computed, new)
            seq.computed += new
            out.prefill_tokens_computed += new
            done = min(seq.computed // bs, len(seq.keys))
            if done > seq.pinned:
                added += self.cache.commit(seq.keys[seq.pinned : done])
                seq.reserved -= done - seq.pinned
                seq.pinned = done
            if seq.computed == seq.prompt:
                seq.generated = 1
                out.first_tokens.append(seq.request_id)
                if seq.max_tokens == 1:
                    self._finish(seq, out)
        self._uncomputed -= out.prefill_tokens_computed
        added += self._advance_decodes(decodes, 1, out)
        out.duration_s = duration
        self._publish(added, evicted)
        return out

    def _admit(self, now: float, out: StepOutcome) -> list[str]:
        """Admit waiting requests in order while slots and KV memory allow; returns evicted keys."""
        evicted: list[str] = []
        cache = self.cache
        bs = self.profile.block_size
        while self._waiting and len(self._running) < self.profile.max_running_requests:
            seq = self._waiting[0]
            matched = cache.match_prefix(seq.keys)
            hit_keys = seq.keys[:matched]
            cache.pin(hit_keys)
            freed = cache.reserve(seq.blocks_needed - matched)
            if freed is None:
                cache.unpin(hit_keys)
                break  # first come, first served: the head waits for memory, so do the others
            evicted += freed
            self._waiting.popleft()
            if self._store_writer is not None and matched:
                self._store_writer(hit_keys)
            if self._store_loader is not None and matched < len(seq.keys):
                load = self._store_loader(seq.keys[matched:])
                if load.blocks:
                    # Loaded blocks enter HBM like computed ones, but were not computed here.
                    cache.commit(seq.keys[matched : matched + load.blocks])
                    matched += load.blocks
                    self._load_s += load.seconds
                    out.loaded_own_tokens += load.own_blocks * bs
                    out.loaded_remote_tokens += load.remote_blocks * bs
            cached = min(matched * bs, seq.prompt - 1)
            seq.computed = cached
            seq.pinned = matched
            seq.reserved = seq.blocks_needed - matched
            self._running.append(seq)
            self._uncomputed -= cached
            self._queries += seq.prompt
            self._hits += cached
            out.cached_tokens[seq.request_id] = cached
            out.admitted.append((seq.request_id, now - seq.submitted_at))
        return evicted

    def _plan_prefill(self, prefills: list[_Sequence], budget: int) -> list[tuple[_Sequence, int]]:
        """Split the token budget: a fair share each first, then the rest in arrival order."""
        share = self.profile.prefill_share_tokens
        grants = []
        for seq in prefills:
            n = min(seq.prompt - seq.computed, share, budget)
            grants.append(n)
            budget -= n
        for i, seq in enumerate(prefills):
            if budget <= 0:
                break
            extra = min(seq.prompt - seq.computed - grants[i], budget)
            grants[i] += extra
            budget -= extra
        return [(seq, n) for seq, n in zip(prefills, grants, strict=True) if n > 0]

    def _fast_forward(self, now: float, until: float, decodes: list[_Sequence], out: StepOutcome) -> list[str]:
        profile = self.profile
        batch = len(decodes)
        context = 0
        steps_left = None
        for seq in decodes:
            context += seq.prompt + seq.generated
            left = seq.max_tokens - seq.generated
            if steps_left is None or left < steps_left:
                steps_left = left
        # Step j lasts base + per_context_token * batch * j: every sequence's context grows by one.
        base = profile.step_overhead_s + profile.decode.step_s(batch, context)
        growth = profile.decode.per_context_token_s * batch
        elapsed = 0.0
        steps = 0
        while steps < steps_left and (steps == 0 or now + elapsed < until):
            elapsed += base + growth * steps
            steps += 1
        out.duration_s = elapsed
        out.num_steps = steps
        return self._advance_decodes(decodes, steps, out)

    def _advance_decodes(self, decodes: list[_Sequence], steps: int, out: StepOutcome) -> list[str]:
        """Each decoding sequence gains `steps` tokens; those at max_tokens finish and leave.
        Returns the keys of output blocks newly cached."""
        added: list[str] = []
        for seq in decodes:
            # These steps computed the KV of the tokens generated before them.
            kv_tokens = seq.prompt + seq.generated - 1 + steps
            seq.generated += steps
            if seq.out_keys:
                added += self._cache_output_blocks(seq, kv_tokens)
            out.tokens.append(seq.request_id)
            if seq.generated >= seq.max_tokens:
                self._finish(seq, out)
        if out.finished:
            done_ids = set(out.finished)
            self._running = [s for s in self._running if s.request_id not in done_ids]
        return added

    def _cache_output_blocks(self, seq: _Sequence, kv_tokens: int) -> list[str]:
        """Commit the output blocks whose KV is now complete (within the memory reserved for them)."""
        full = min(kv_tokens // self.profile.block_size - len(seq.keys), len(seq.out_keys))
        done = min(full, seq.out_pinned + seq.reserved)
        if done <= seq.out_pinned:
            return []
        added = self.cache.commit(seq.out_keys[seq.out_pinned : done])
        seq.reserved -= done - seq.out_pinned
        seq.out_pinned = done
        return added

    def _finish(self, seq: _Sequence, out: StepOutcome) -> None:
        out.finished.append(seq.request_id)
        self._ids.discard(seq.request_id)
        self._free(seq)

    def _free(self, seq: _Sequence) -> None:
        self.cache.unpin(seq.keys[: seq.pinned])
        self.cache.unpin(seq.out_keys[: seq.out_pinned])
        self.cache.release(seq.reserved)
        seq.pinned = seq.reserved = seq.out_pinned = 0

    def _publish(self, added: list[str], evicted: list[str]) -> None:
        if self._on_cache_change is None or not (added or evicted):
            return
        if added and evicted:
            # Evictions happen at admission, before this step's blocks are computed: a key evicted
            # and computed again in the same step is cached at the end, so it is only "added".
            recomputed = set(added)
            evicted = [key for key in evicted if key not in recomputed]
        self._on_cache_change(added, evicted)
