"""What `kvgate bench routers` compares (targets), with what settings, and what each target yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench import peers
from kvgate.bench.loadgen import ClosedLoopResult, ReplaySummary
from kvgate.config.settings import Settings
from kvgate.engines.model import TINY_MODEL_NAME
from kvgate.scheduler.registry import POLICY_NAMES

KVGATE = "kvgate"
DIRECT = "direct"
MODEL = "kvgate/mock-llm"
# The mock engines run with the default --kvs-chunk-size, which is their KV block size.
ENGINE_BLOCK_TOKENS = Settings().kvs_chunk_size
# kvgate's cache-aware threshold in the overhead phase: below the ~400-token prompt, so the phase
# measures the cache-aware path (tokenize, hash, store lookup) rather than load-only routing.
OVERHEAD_CACHE_AWARE_MIN_TOKENS = 256


# What a kvgate target routes on: the store index the engines publish to (Redis), the engines' own
# KV events, or both (each instance's hit is the longer of the two; docs/KV_EVENTS.md).
VIEWS = ("store", "events", "both")
ENGINE_KINDS = ("mock", "vllm")
# Real engines: the tiny model's context (it has 32K positions; on CPU, prefill cost grows with it)
# and KV blocks per engine (512 B of KV per token: 1,024 blocks are 128 MiB of the 1 GiB KV space).
VLLM_MAX_MODEL_LEN = 8192
VLLM_ENGINES = 2
VLLM_CACHE_BLOCKS = 1024


@dataclass(frozen=True)
class Target:
    router: str  # kvgate | sglang-router | vllm-router | direct
    policy: str = ""
    workers: int = 1  # kvgate only: `kvgate serve --workers`
    view: str = "store"  # kvgate only: one of VIEWS

    @property
    def label(self) -> str:
        if self.router != KVGATE:
            return f"{self.router} {self.policy}".strip()
        workers = f" x{self.workers}" if self.workers != 1 else ""
        return f"{self.router} {self.policy}@{self.view}{workers}"

    @classmethod
    def parse(cls, text: str, default_view: str = "store") -> Target:
        """router[:policy], or kvgate:policy[@view][:workers] (view: store, events or both; without one,
        `default_view`)."""
        router, _, policy = text.partition(":")
        policy, _, workers = policy.partition(":")
        policy, at, view = policy.partition("@")
        if workers and router != KVGATE:
            raise ValueError(f"{text!r}: only kvgate takes a worker count")
        if workers and (not workers.isdigit() or int(workers) < 1):
            raise ValueError(f"{text!r}: the worker count must be a positive integer")
        if at and router != KVGATE:
            raise ValueError(f"{text!r}: only kvgate takes a cache view (@store, @events, @both)")
        if at and view not in VIEWS:
            raise ValueError(f"{text!r}: the cache view must be one of {list(VIEWS)}")
        if router == DIRECT:
            return cls(DIRECT)
        if router not in (KVGATE, *peers.PEER_VERSIONS):
            raise ValueError(f"unknown router {router!r}; choose from {[KVGATE, *peers.PEER_VERSIONS, DIRECT]}")
        # kvgate takes any of its dispatch policies (e.g. kvgate:prefix); peers the two they share.
        policies = list(POLICY_NAMES) if router == KVGATE else list(peers.PEER_POLICIES)
        if policy not in policies:
            raise ValueError(f"{text!r}: policy must be one of {policies}")
        return cls(router, policy, int(workers or 1), view or default_view)

    def with_workers(self, counts: tuple[int, ...]) -> list[Target]:
        """kvgate once per worker count; any other target as it is."""
        if self.router != KVGATE:
            return [self]
        return [Target(self.router, self.policy, count, self.view) for count in counts]

    @property
    def reads_store(self) -> bool:
        return self.router == KVGATE and self.view in ("store", "both")


DEFAULT_TARGETS = (
    Target(DIRECT),
    *(Target(router, policy) for router in (KVGATE, *peers.PEER_VERSIONS) for policy in peers.PEER_POLICIES),
)


@dataclass(frozen=True)
class RoutersConfig:
    trace: str
    engines: int = 4
    # Mock engines: KV blocks of 256 tokens in each engine's own cache (HBM: 1,664 blocks = 426K
    # tokens, an 80 GB GPU's) and in the store segment behind it (the host DRAM it lends to the KV
    # store: 11,648 more, ~3.4M tokens in all, as `kvgate simulate` assumes; docs/BENCHMARKS.md).
    # The store index lists the segment, the KV events the cache: the store knows more, as in
    # production. Real engines: their --num-gpu-blocks-override (no store).
    cache_capacity_blocks: int = 1664
    store_segment_blocks: int = 11648
    # speedup x time_scale = 1: the engines see the trace's real load, only faster. Kept small
    # because routers' CPU work (tokenizing, hashing) is not scaled: at 10x a tokenizing router
    # does ten times its real work per unit of engine time, on the engines' cores.
    time_scale: float = 0.25
    speedup: float = 4.0
    limit: int = 500
    max_tokens_cap: int = 32
    tokenizer: str = ""
    overhead_backends: int = 2
    overhead_concurrency: tuple[int, ...] = (1, 32)
    overhead_duration_s: float = 3.0
    overhead_max_requests: int = 200_000
    targets: tuple[Target, ...] = DEFAULT_TARGETS
    venv_dir: Path | None = None
    install_peers: bool = True
    log_dir: Path | None = None
    # Replay phase: routers on their own core(s), engines and the load generator on the others,
    # so no router's CPU work slows the engines' simulated clocks (see cpu_split).
    pin_cpus: bool = True
    # mock: `kvgate mock-engine` processes, fresh per target. vllm: real vLLM engines (the tiny model,
    # on alternate cores), started once; their prefix caches are emptied before each target.
    engines_kind: str = "mock"
    # Trace prompts cut to their first N tokens (whole trace blocks kept, the reuse structure of the
    # leading part intact); None: whole prompts. Real engines: at most VLLM_MAX_MODEL_LEN - max_tokens_cap.
    max_prompt_tokens: int | None = None

    @property
    def model(self) -> str:
        return TINY_MODEL_NAME if self.engines_kind == "vllm" else MODEL

    @property
    def has_store(self) -> bool:
        """Real engines publish to no store: only their KV events can be routed on."""
        return self.engines_kind == "mock"


@dataclass
class TargetResult:
    target: Target
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    replay: ReplaySummary | None = None
    ttfts_s: tuple[float, ...] = ()
    # Prompt tokens each engine was asked to compute (its vllm:prefix_cache_queries counter): the spread.
    engine_prompt_tokens: tuple[int, ...] = ()
    # The engines' own hit ratio over the target's replay: the rise of vllm:prefix_cache_hits over that
    # of vllm:prefix_cache_queries (real engines: what they really reused).
    engine_hit_ratio: float | None = None
    # The replayed slice's bound: one infinite cache shared by every engine (trace.ideal_hit_ratio).
    ideal_hit_ratio: float | None = None
    # kvgate only: answers by how the engine's cached tokens compared with the hit the cache view
    # predicted (agree, engine_higher, gateway_higher, unreported): is the view what the engines hold?
    hit_comparisons: dict[str, int] = field(default_factory=dict)
    # kvgate only: mean milliseconds per request in each gateway stage (tokenize, kvs, schedule).
    gateway_stage_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load_average: tuple[float, float, float] | None = None  # 1-min load when the target finished
    overhead: dict[int, ClosedLoopResult] = field(default_factory=dict)

    @property
    def view_agreement(self) -> float | None:
        """Share of compared answers whose engine found what the cache view predicted (within a chunk)."""
        compared = sum(n for outcome, n in self.hit_comparisons.items() if outcome != "unreported")
        return self.hit_comparisons.get("agree", 0) / compared if compared else None

    @property
    def load_skew(self) -> float | None:
        """Busiest engine's prompt tokens / the mean: 1.0 is an even spread."""
        tokens = self.engine_prompt_tokens
        return max(tokens) * len(tokens) / sum(tokens) if tokens and sum(tokens) else None
