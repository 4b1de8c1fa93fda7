"""What `kvgate bench routers` compares (targets), with what settings, and what each target yields."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kvgate.bench import peers
from kvgate.bench.loadgen import ClosedLoopResult, ReplaySummary
from kvgate.config.settings import Settings
from kvgate.scheduler.registry import POLICY_NAMES

KVGATE = "kvgate"
DIRECT = "direct"
MODEL = "kvgate/mock-llm"
# The mock engines run with the default --kvs-chunk-size, which is their KV block size.
ENGINE_BLOCK_TOKENS = Settings().kvs_chunk_size
# kvgate's cache-aware threshold in the overhead phase: below the ~400-token prompt, so the phase
# measures the cache-aware path (tokenize, hash, store lookup) rather than load-only routing.
OVERHEAD_CACHE_AWARE_MIN_TOKENS = 256


@dataclass(frozen=True)
class Target:
    router: str  # kvgate | sglang-router | vllm-router | direct
    policy: str = ""
    workers: int = 1  # kvgate only: `kvgate serve --workers`

    @property
    def label(self) -> str:
        workers = f" x{self.workers}" if self.router == KVGATE and self.workers != 1 else ""
        return f"{self.router} {self.policy}{workers}".strip()

    @classmethod
    def parse(cls, text: str) -> Target:
        """router[:policy], or kvgate:policy:workers."""
        router, _, policy = text.partition(":")
        policy, _, workers = policy.partition(":")
        if workers and router != KVGATE:
            raise ValueError(f"{text!r}: only kvgate takes a worker count")
        if workers and (not workers.isdigit() or int(workers) < 1):
            raise ValueError(f"{text!r}: the worker count must be a positive integer")
        if router == DIRECT:
            return cls(DIRECT)
        if router not in (KVGATE, *peers.PEER_VERSIONS):
            raise ValueError(f"unknown router {router!r}; choose from {[KVGATE, *peers.PEER_VERSIONS, DIRECT]}")
        # kvgate takes any of its dispatch policies (e.g. kvgate:prefix); peers the two they share.
        policies = list(POLICY_NAMES) if router == KVGATE else list(peers.PEER_POLICIES)
        if policy not in policies:
            raise ValueError(f"{text!r}: policy must be one of {policies}")
        return cls(router, policy, int(workers or 1))

    def with_workers(self, counts: tuple[int, ...]) -> list[Target]:
        """kvgate once per worker count; any other target as it is."""
        if self.router != KVGATE:
            return [self]
        return [Target(self.router, self.policy, count) for count in counts]


DEFAULT_TARGETS = (
    Target(DIRECT),
    *(Target(router, policy) for router in (KVGATE, *peers.PEER_VERSIONS) for policy in peers.PEER_POLICIES),
)


@dataclass(frozen=True)
class RoutersConfig:
    trace: str
    engines: int = 4
    # KV blocks of 256 tokens per engine: ~3.4M tokens, an 80 GB GPU's HBM (426K tokens) plus the
    # host DRAM it lends to a KV store, as `kvgate simulate` assumes (docs/BENCHMARKS.md). With HBM
    # alone most of the trace's reuse is evicted before it comes back and no router finds hits.
    cache_capacity_blocks: int = 13312
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


@dataclass
class TargetResult:
    target: Target
    status: str = "ok"  # ok | unavailable | failed
    reason: str = ""
    replay: ReplaySummary | None = None
    ttfts_s: tuple[float, ...] = ()
    # Prompt tokens each engine was asked to compute (its vllm:prefix_cache_queries counter): the spread.
    engine_prompt_tokens: tuple[int, ...] = ()
    # kvgate only: mean milliseconds per request in each gateway stage (tokenize, kvs, schedule).
    gateway_stage_ms: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    load_average: tuple[float, float, float] | None = None  # 1-min load when the target finished
    overhead: dict[int, ClosedLoopResult] = field(default_factory=dict)

    @property
    def load_skew(self) -> float | None:
        """Busiest engine's prompt tokens / the mean: 1.0 is an even spread."""
        tokens = self.engine_prompt_tokens
        return max(tokens) * len(tokens) / sum(tokens) if tokens and sum(tokens) else None
