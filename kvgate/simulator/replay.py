"""Discrete-event replay of a trace over simulated engines, routed by the gateway's own scheduler.

Virtual time only: a heap of engine step ends and stats scrapes, merged with the trace's arrivals.
Each arrival goes through exactly what `kvgate serve` runs for a request: `Scheduler.wants_kvs`,
a lookup in a real `EmbeddedKVSIndex` (which the simulated engines fill and empty as they cache and
evict), candidates loaded from a `LoadAccount` (dispatches, first tokens, finishes, engine stats
scraped every `stats_poll_interval_s`), `Scheduler.decide`, then `LoadAccount.dispatch`.

Engines are `EngineCore`s with 512-token blocks (one trace hash id each). Pure decode stretches
are fast-forwarded up to the next arrival (see EngineCore.step), which is what makes an hour of
trace take seconds.

Store models (`--store-model`):
- shared (a Mooncake deployment): each instance has an HBM prefix cache of an eighth of its
  capacity (profile.hbm_blocks) and a DRAM segment of the rest in one shared store (engine_model.store): what it computes
  goes to its segment, and a prefix missing from HBM is loaded from its own segment at host-link
  bandwidth or from another's at network bandwidth; HBM hits the store lost are written back. The
  index reports the segments.
- local: one cache per instance of the whole capacity, loaded for free, reported as is (no
  instance can use another's blocks).

What the gateway's lookups see follows `--kvs-backend`, as in `kvgate serve`:
- a store (mooncake, the default, or any other store backend): the index the store model reports
  (the segments with shared, each cache with local), up to date at every step's start.
- kv_events: no store is asked; each instance's own HBM prefix cache as its KV events report it
  (blocks computed or loaded into HBM, blocks evicted), one batch per step, visible
  `kv_events_lag_s` after the step ends (simulator/kv_events_view.py), read as the gateway reads
  its events index: each instance's own prefix (`EngineHits`), which no other instance can load.
  The store model still decides what engines can load.
- a store with `engine_events` (`--kv-events-beside-store`): both, as a gateway whose instances
  have a `kv_events_endpoint` beside its store: the store's index for the pool, the events (same
  lag) for each engine's own HBM prefix; an instance's local prefix is the longer of the two.

Before dispatch the scheduler's rejection filter runs (`--early-rejection`); a rejected request
is counted and never reaches an engine. Measured TTFTs (first token minus dispatch) calibrate the
TTFT model as the gateway's first bytes do.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.engine_model import EngineCore, EngineRequest, ServiceProfile, StepOutcome
from kvgate.engine_model.store import SharedStore, StoreLoad, StoreProfile
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.tiers import EngineHits, EnginePrefix
from kvgate.scheduler.types import Candidate, EngineStats, TTFTPrediction
from kvgate.simulator.kv_events_view import KVEventsView
from kvgate.simulator.profile import STORE_MODELS, hbm_blocks
from kvgate.simulator.replicas import GatewayReplicas
from kvgate.simulator.report import HitRatioReference, SimulationSummary, SLOOutcome, summarise
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest, fleet_lru_hit_ratio, ideal_hit_ratio

KVS_PORT = 17901

# Heap priorities at equal times: finished work and scrapes first, then arrivals, then step starts,
# so an engine's next step sees every request that arrived at the instant it begins.
_STEP_END, _SCRAPE, _ARRIVAL, _STEP_START = 0, 1, 2, 3


def simulated_instances(count: int) -> tuple[InstanceConfig, ...]:
    """Instance i serves on 127.0.0.{i+2} and its KV cache is published under that host."""
    if not 1 <= count <= 250:
        raise ValueError("instances must be between 1 and 250 (one loopback IP each)")
    return tuple(
        InstanceConfig(
            id=f"sim-{i:03d}",
            url=f"http://127.0.0.{i + 2}:8000",
            model="trace",
            kvs_endpoints=(f"127.0.0.{i + 2}:{KVS_PORT}",),
        )
        for i in range(count)
    )


@dataclass
class SimInstance:
    """One simulated engine and what the replay tracks about it."""

    config: InstanceConfig
    engine: EngineCore
    busy: bool = False  # a step is running or about to start
    pending: StepOutcome | None = None
    pending_ends_at: float = 0.0  # when the pending step ends
    requests: int = 0


class Replay:
    """One policy over one trace. Build, `run()`, read the summary."""

    def __init__(
        self,
        requests: Sequence[TraceRequest],
        settings: Settings,
        num_instances: int,
        profile: ServiceProfile,
        *,
        seed: int = 0,
        show_progress: bool = False,
        reference: HitRatioReference,
        store_model: str = "shared",
        replicas: GatewayReplicas | None = None,
        kv_events_lag_s: float = 0.0,
        engine_events: bool = False,
    ) -> None:
        if profile.block_size != TRACE_BLOCK_TOKENS or settings.kvs_chunk_size != TRACE_BLOCK_TOKENS:
            raise ValueError(
                f"the trace's blocks are {TRACE_BLOCK_TOKENS} tokens: the profile's block size and"
                f" --kvs-chunk-size must be too (got {profile.block_size} and {settings.kvs_chunk_size})"
            )
        if store_model == "local":
            # No instance can load another's blocks: the TTFT model must never plan a transfer.
            settings = settings.model_copy(update={"kvcache_balancing_threshold": math.inf})
        self._requests = requests
        self._settings = settings
        self._show_progress = show_progress
        configs = simulated_instances(num_instances)
        self.scheduler = Scheduler(settings, configs, rng=random.Random(seed))
        # One gateway, or several replicas each with its own account (simulator/replicas.py).
        self._replicas = replicas
        self.account: LoadAccount | GatewayReplicas = replicas or LoadAccount(settings.request_local_account_staleness_s)
        # The store's index (the segments, or each cache with the local model), unless the gateway
        # asks no store (kvs_backend kv_events); the engines' events feed an index of their own.
        events_alone = settings.kvs_backend == KVSBackendName.KV_EVENTS
        self.index: EmbeddedKVSIndex | None = None if events_alone else EmbeddedKVSIndex()
        self.events = (KVEventsView(EmbeddedKVSIndex(), kv_events_lag_s) if events_alone or engine_events
                       else None)
        self.store = self._shared_store(store_model, profile, settings, len(configs))
        if self.store is not None:
            profile = dataclasses.replace(profile, cache_capacity_blocks=hbm_blocks(profile.cache_capacity_blocks))
        self.instances = [
            SimInstance(c, EngineCore(profile, self._publisher(slot, c), self._store_loader(slot, c),
                                      self._store_writer(slot, c)))
            for slot, c in enumerate(configs)
        ]
        self._slot_of = {inst.config.id: slot for slot, inst in enumerate(self.instances)}
        self._reference = reference
        self._next_arrival_at = math.inf
        self._heap: list[tuple[float, int, int, int]] = []
        self._seq = 0
        n = len(requests)
        self.ttft = [math.nan] * n
        self.queue = [math.nan] * n
        self.finish = [math.nan] * n
        self.tbt = [math.nan] * n
        self.rejected = [False] * n
        self._predictions: dict[int, tuple[TTFTPrediction, float]] = {}
        self.prediction_errors: list[float] = []  # measured minus predicted TTFT, in first-token order
        self.steps = 0
        self.prefill_time_s = 0.0
        self.transfer_tokens = 0

    @staticmethod
    def _shared_store(store_model: str, profile: ServiceProfile, settings: Settings, count: int) -> SharedStore | None:
        if store_model not in STORE_MODELS:
            raise ValueError(f"--store-model: unknown {store_model!r}; choose from {', '.join(STORE_MODELS)}")
        if store_model == "local":
            return None
        # The TTFT model's profile (--kv-*) is what the simulated hardware does, until calibrated.
        store_profile = StoreProfile(settings.kv_bytes_per_token, settings.kv_host_bandwidth_gb_s * 1e9,
                                     settings.kv_network_bandwidth_gb_s * 1e9)
        capacity = profile.cache_capacity_blocks
        return SharedStore(count, max(1, capacity - hbm_blocks(capacity)), TRACE_BLOCK_TOKENS, store_profile)

    def _publisher(self, slot: int, config: InstanceConfig) -> Callable[[list[str], list[str]], None]:
        index = self.index
        store = self.store
        endpoint = config.kvs_endpoints[0]
        record = self.events.recorder(endpoint) if self.events is not None else None

        def on_cache_change(added: list[str], evicted: list[str]) -> None:
            if store is not None:
                # HBM evictions stay in the store; what was computed goes to this instance's segment.
                self._index_segment(endpoint, *store.store(slot, added))
            elif index is not None:  # the local model: the store's index is each cache itself
                if evicted:
                    index.remove(evicted, endpoint)
                if added:
                    index.add(added, endpoint)
            if record is not None:
                record(added, evicted)

        return on_cache_change

    def _store_writer(self, slot: int, config: InstanceConfig) -> Callable[[tuple[str, ...]], None] | None:
        store = self.store
        if store is None:
            return None
        endpoint = config.kvs_endpoints[0]
        # An HBM hit the store lost (hot in HBM, so never loaded from it) is written back.
        return lambda keys: self._index_segment(endpoint, *store.restore(slot, keys))

    def _index_segment(self, endpoint: str, stored: list[str], dropped: list[str]) -> None:
        if self.index is None:
            return  # the gateway reads the engines' events alone, no store index
        if dropped:
            self.index.remove(dropped, endpoint)
        if stored:
            self.index.add(stored, endpoint)

    def _store_loader(
        self, slot: int, config: InstanceConfig
    ) -> Callable[[tuple[str, ...]], StoreLoad] | None:
        store = self.store
        if store is None:
            return None
        if self.events is None:
            return lambda keys: store.plan_load(slot, keys)
        # Blocks loaded into HBM are stored blocks to the engine's events (the core reports only
        # the ones it computes).
        record = self.events.recorder(config.kvs_endpoints[0])

        def load(keys: tuple[str, ...]) -> StoreLoad:
            plan = store.plan_load(slot, keys)
            if plan.blocks:
                record(list(keys[: plan.blocks]), [])
            return plan

        return load

    def _push(self, when: float, priority: int, instance: int) -> None:
        self._seq += 1
        heapq.heappush(self._heap, (when, priority, self._seq, instance))

    # --- the loop ---

    def run(self) -> SimulationResult:
        started = time.perf_counter()
        requests = self._requests
        heap = self._heap
        scrape_every = self._settings.stats_poll_interval_s
        if requests:
            self._push(requests[0].arrival_s, _SCRAPE, -1)
        progress = tqdm(total=len(requests), unit="req", disable=not self._show_progress, leave=False)
        next_arrival = 0
        self._next_arrival_at = requests[0].arrival_s if requests else math.inf
        while next_arrival < len(requests) or heap:
            arrival_at = self._next_arrival_at
            if heap and (heap[0][0], heap[0][1]) < (arrival_at, _ARRIVAL):
                when, kind, _, slot = heapq.heappop(heap)
                if kind == _STEP_END:
                    self._end_step(slot, when)
                elif kind == _STEP_START:
                    self._start_step(slot, when)
                elif kind != _SCRAPE:
                    self._on_event(kind, slot, when)
                elif next_arrival < len(requests) or self._has_work():
                    self._scrape(when)
                    self._push(when + scrape_every, _SCRAPE, -1)
                continue
            next_arrival += 1
            self._next_arrival_at = (
                requests[next_arrival].arrival_s if next_arrival < len(requests) else math.inf
            )
            self._dispatch(requests[next_arrival - 1], arrival_at)
            progress.update(1)
        progress.close()
        return self._result(time.perf_counter() - started)

    def _prompt_instances(self) -> list[SimInstance]:
        """The instances whose prefix caches the hit ratio counts (those that compute prompts)."""
        return self.instances

    def _has_work(self) -> bool:
        return any(inst.busy for inst in self.instances)

    def _on_event(self, kind: int, slot: int, now: float) -> None:
        """Events of kinds a subclass pushes (the PD replay's KV transfers)."""
        raise ValueError(f"unknown event kind {kind}")

    @property
    def policy_name(self) -> str:
        return self.scheduler.policy.name

    def blocks(self, req: TraceRequest) -> list[BlockHash]:
        """The request's blocks as the gateway's hasher would give them for this trace."""
        full = req.input_length // TRACE_BLOCK_TOKENS
        blocks = [BlockHash(str(h), TRACE_BLOCK_TOKENS, True) for h in req.hash_ids[:full]]
        remainder = req.input_length - full * TRACE_BLOCK_TOKENS
        if remainder and self._settings.kvs_enable_save_unfull_chunk:
            blocks.append(BlockHash(str(req.hash_ids[full]), remainder, False))
        return blocks

    def _dispatch(self, req: TraceRequest, now: float) -> None:
        scheduler = self.scheduler
        account = self.account
        if self.events is not None:
            self.events.deliver_until(now)
        n = req.input_length
        blocks = self.blocks(req)
        # Engines cache and publish under the store key names the gateway looks up.
        keys = scheduler.block_keys(blocks)
        locations = engine = None
        if scheduler.wants_kvs(n):
            if self.index is not None:
                locations = [self.index.holders(key) for key in keys]
            if self.events is not None:
                engine = self._engine_hits(n, blocks, [self.events.index.holders(key) for key in keys])
        if self._replicas is not None:
            self._replicas.sync_until(now)  # the account syncs due before this decision
        candidates = [
            Candidate(inst.config.id, inst.config.role, account.load(inst.config.id))
            for inst in self.instances
        ]
        decision = scheduler.decide(n, blocks, locations, candidates, engine=engine)
        max_tokens = max(1, req.output_length)
        if scheduler.judge(decision, candidates) is not None:
            self.rejected[req.index] = True
            return
        chosen = decision.scores[0]
        rid = str(req.index)
        account.dispatch(rid, chosen.id, chosen.prefix_miss_tokens, now)
        prediction = scheduler.observe_dispatch(decision, chosen.id, n, max_tokens)
        if prediction is not None:
            self._predictions[req.index] = (prediction, now)
        slot = self._slot_of[chosen.id]
        inst = self.instances[slot]
        inst.requests += 1
        full_keys = tuple(keys[: n // TRACE_BLOCK_TOKENS])
        # Every request yields at least its first token, whatever the trace recorded.
        inst.engine.submit(EngineRequest(rid, full_keys, n, max_tokens), now)
        if not inst.busy:
            inst.busy = True
            self._push(now, _STEP_START, slot)

    def _engine_hits(self, n: int, blocks: list[BlockHash], held: list[tuple[str, ...]]) -> EngineHits:
        """The events index's answer as the gateway's events view gives it: each instance's own
        contiguous prefix, all of it in GPU memory (the simulated engines have no CPU tier)."""
        prefixes = self.scheduler.store_hits(n, blocks, held)
        return EngineHits({instance_id: EnginePrefix(tokens) for instance_id, tokens in prefixes.items() if tokens})

    def _start_step(self, slot: int, now: float) -> None:
        inst = self.instances[slot]
        out = inst.engine.step(now, fast_forward_until=self._next_arrival_at)
        if self.events is not None:
            self.events.step_ends(inst.config.kvs_endpoints[0], now + out.duration_s)
        if out.num_steps == 0:
            inst.busy = False
            return
        self.steps += out.num_steps
        if out.prefill_tokens_computed:
            self.prefill_time_s += out.duration_s
        for rid, waited in out.admitted:
            self.queue[int(rid)] = waited
        self.transfer_tokens += out.loaded_remote_tokens
        inst.pending = out
        inst.pending_ends_at = now + out.duration_s
        self._push(inst.pending_ends_at, _STEP_END, slot)

    def _end_step(self, slot: int, now: float) -> None:
        inst = self.instances[slot]
        out = inst.pending
        inst.pending = None
        self._record(inst, out, now)
        if not inst.engine.has_work():
            inst.busy = False
        elif self._next_arrival_at > now:
            self._start_step(slot, now)
        else:
            # An arrival at this very instant must be dispatched before the next step starts.
            self._push(now, _STEP_START, slot)

    def _record(self, inst: SimInstance, out: StepOutcome, now: float) -> None:
        """A step's first tokens and finishes: timings and the account."""
        account = self.account
        requests = self._requests
        for rid in out.first_tokens:
            i = int(rid)
            self.ttft[i] = now - requests[i].arrival_s
            account.first_token(rid, now)
            predicted = self._predictions.pop(i, None)
            if predicted is not None:
                self.prediction_errors.append(self.scheduler.observe_ttft(predicted[0], now - predicted[1]))
        for rid in out.finished:
            i = int(rid)
            self.finish[i] = now
            # Mean time between tokens after the first (0 for a one-token answer).
            first_token_at = requests[i].arrival_s + self.ttft[i]
            self.tbt[i] = (now - first_token_at) / max(1, requests[i].output_length - 1)
            account.release(rid)

    def _scrape(self, now: float) -> None:
        """What the gateway's stats poller does: read every engine's gauges, age the account."""
        for inst in self.instances:
            stats = inst.engine.stats()
            self.account.observe_engine(
                inst.config.id,
                EngineStats(stats.num_running, stats.num_waiting, stats.kv_cache_usage_ratio),
                now,
            )
        self.account.expire(now)

    def _result(self, wall_time_s: float) -> SimulationResult:
        engine_stats = [inst.engine.stats() for inst in self._prompt_instances()]
        ttfts = [t for t in self.ttft if not math.isnan(t)]
        summary = summarise(
            policy=self.policy_name,
            ttfts=ttfts,
            queue_times=[q for q in self.queue if not math.isnan(q)],
            arrivals=[r.arrival_s for r in self._requests],
            finishes=[f for f in self.finish if not math.isnan(f)],
            per_instance_requests=[inst.requests for inst in self.instances],
            cached_tokens=sum(s.prefix_cache_hits for s in engine_stats),
            prompt_tokens=sum(s.prefix_cache_queries for s in engine_stats),
            reference=self._reference,
            prefill_time_s=self.prefill_time_s,
            engine_steps=self.steps,
            wall_time_s=wall_time_s,
            slo=SLOOutcome.measure(self.ttft, self.tbt, self.rejected, self._settings.ttft_slo_s,
                                   self._settings.tbt_slo_s),
            transfer_tokens=self.transfer_tokens,
            prediction_errors=self.prediction_errors,
        )
        return SimulationResult(summary, ttfts, [t for t in self.tbt if not math.isnan(t)])


@dataclass(frozen=True)
class SimulationResult:
    summary: SimulationSummary
    # Every request's time to first token, in trace order (for CDF plots).
    ttfts: list[float]
    # Every finished request's mean time between tokens after the first (0 for one-token answers).
    tbts: list[float] = field(default_factory=list)


def hit_ratio_reference(requests: Sequence[TraceRequest], fleet_capacity_blocks: int) -> HitRatioReference:
    # The simulated engines' blocks are the trace's.
    ideal = ideal_hit_ratio(requests, engine_block_tokens=TRACE_BLOCK_TOKENS)
    return HitRatioReference(ideal, fleet_lru_hit_ratio(requests, fleet_capacity_blocks))


def simulate(
    requests: Sequence[TraceRequest],
    settings: Settings,
    num_instances: int,
    profile: ServiceProfile,
    *,
    seed: int = 0,
    show_progress: bool = False,
    reference: HitRatioReference | None = None,
    store_model: str = "shared",
    replicas: GatewayReplicas | None = None,
    kv_events_lag_s: float = 0.0,
    engine_events: bool = False,
) -> SimulationResult:
    """Replay `requests` with `settings.effective_policy` over `num_instances` simulated engines,
    through one gateway or through `replicas`."""
    replay = Replay(
        requests,
        settings,
        num_instances,
        profile,
        seed=seed,
        show_progress=show_progress,
        reference=reference or hit_ratio_reference(requests, num_instances * profile.cache_capacity_blocks),
        store_model=store_model,
        replicas=replicas,
        kv_events_lag_s=kv_events_lag_s,
        engine_events=engine_events,
    )
    return replay.run()
