"""The processes of a `kvgate bench routers` run: mock engines, instant backends, the router under test."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvgate.bench import peers
from kvgate.bench.routers.targets import (
    DIRECT,
    KVGATE,
    MODEL,
    OVERHEAD_CACHE_AWARE_MIN_TOKENS,
    VLLM_MAX_MODEL_LEN,
    RoutersConfig,
    Target,
)
from kvgate.config.engines import engines_home
from kvgate.engines.install import vllm_venv
from kvgate.engines.model import tiny_model
from kvgate.engines.vllm import VLLMEngine, VLLMEngineSpec, fleet_specs, vllm_fleet
from kvgate.processes import LocalProcess, free_port

_START_TIMEOUT_S = 90.0

def _models_listed(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=1.0) as response:
            return response.status == 200 and bool(json.loads(response.read()).get("data"))
    except (OSError, urllib.error.URLError, ValueError):
        return False


@contextlib.contextmanager
def _processes(specs: Sequence[tuple[list[str], Path, str, str]]) -> Iterator[list[LocalProcess]]:
    """Start every (argv, log, base_url, what) at once, wait until each lists its models, stop all on exit."""
    started: list[LocalProcess] = []
    try:
        for argv, log_path, _, _ in specs:
            started.append(LocalProcess(argv, log_path))
        for process, (_, _, base_url, what) in zip(started, specs, strict=True):
            process.wait_ready(lambda url=base_url: _models_listed(url), what, _START_TIMEOUT_S)
        yield started
    finally:
        for process in started:
            process.stop()


def _kvgate_cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


@dataclass(frozen=True)
class RouterProcess:
    url: str  # the base URL clients send to
    pid: int | None  # None for DIRECT: no router between the clients and the engine


@dataclass(frozen=True)
class Engine:
    url: str
    kvs_endpoint: str  # the endpoint it claims its blocks under in Redis ("" : it publishes to no store)
    kv_events_endpoint: str = ""  # where a subscriber connects for its KV events ("": it publishes none)
    kv_events_replay_endpoint: str = ""
    max_model_len: int | None = None  # real engines: their --max-model-len


@dataclass(frozen=True)
class RealFleet:
    """Real vLLM engines, started once for every target, and what kvgate must share with them."""

    engines: list[Engine]
    handles: list[VLLMEngine]
    gateway_settings: dict  # tokenizer, block size and hash seed: kvgate hashes as the engines do

    def reset(self) -> None:
        """A cold start for the next target: every engine's prefix cache emptied."""
        for handle in self.handles:
            handle.reset_prefix_cache()


def vllm_fleet_specs(config: RoutersConfig, model_dir: Path) -> list[VLLMEngineSpec]:
    return fleet_specs(model_dir, config.model, config.engines, config.cache_capacity_blocks, VLLM_MAX_MODEL_LEN)


@contextlib.contextmanager
def vllm_engines(config: RoutersConfig, log_dir: Path) -> Iterator[RealFleet]:
    """`config.engines` real vLLM engines serving the tiny model, publishing KV events (no store).

    Raises EnginesMissing (with the install command) when the engines' virtualenv is not there.
    """
    home = engines_home()
    venv = vllm_venv(home)
    model_dir = tiny_model(venv, home)
    with vllm_fleet(vllm_fleet_specs(config, model_dir), venv, log_dir) as handles:
        spec = handles[0].spec
        engines = [Engine(h.url, "", h.spec.kv_events_endpoint, h.spec.kv_events_replay_endpoint,
                          h.spec.max_model_len) for h in handles]
        yield RealFleet(engines, handles, {"tokenizer": str(model_dir), "kvs_chunk_size": spec.block_size,
                                           "hash_seed": spec.hash_seed})


@contextlib.contextmanager
def mock_engines(config: RoutersConfig, redis_url: str, log_dir: Path) -> Iterator[list[Engine]]:
    """Fresh mock engines: a cache, a store segment behind it in Redis's index, KV events."""
    engines, specs = [], []
    for i in range(config.engines):
        port = free_port()
        endpoint = f"127.0.0.{2 + i}"
        argv = _kvgate_cli("mock-engine", "--port", str(port), "--model", MODEL, "--time-scale", str(config.time_scale),
                           "--kvs-backend", "redis", "--kvs-redis-url", redis_url, "--kvs-local-ip", endpoint)
        if config.tokenizer:
            argv += ["--tokenizer", config.tokenizer]
        argv += ["--cache-capacity-blocks", str(config.cache_capacity_blocks),
                 "--store-segment-blocks", str(config.store_segment_blocks)]
        # Every engine publishes its KV events as vLLM does (bound on every interface, reached on
        # loopback), whether or not the target reads them: the engines' work is the same for all.
        events_port, replay_port = free_port(), free_port()
        argv += ["--kv-events-endpoint", f"tcp://*:{events_port}",
                 "--kv-events-replay-endpoint", f"tcp://*:{replay_port}"]
        url = f"http://127.0.0.1:{port}"
        engines.append(Engine(url, endpoint, f"tcp://127.0.0.1:{events_port}", f"tcp://127.0.0.1:{replay_port}"))
        specs.append((argv, log_dir / f"engine-{i}-{port}.log", url, f"mock engine {i}"))
    with _processes(specs):
        yield engines


@contextlib.contextmanager
def instant_backends(count: int, log_dir: Path) -> Iterator[list[Engine]]:
    backends, specs = [], []
    for i in range(count):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        backends.append(Engine(url, ""))
        argv = [sys.executable, "-m", "kvgate.bench.instant_backend", "--port", str(port), "--model", MODEL]
        specs.append((argv, log_dir / f"instant-{i}-{port}.log", url, f"instant backend {i}"))
    with _processes(specs):
        yield backends


def kvgate_config(policy: str, port: int, engines: Sequence[Engine], redis_url: str, tokenizer: str,
                  workers: int = 1, cache_aware_min_tokens: int | None = None, view: str = "store",
                  model: str = MODEL, matching: dict | None = None) -> dict:
    """The gateway's YAML settings: the engines as instances, with their Redis endpoints as
    kvs_endpoints when the view reads the store, their KV events endpoints when it reads events;
    `matching`: settings that must match the engines (real engines: RealFleet.gateway_settings)."""
    store, events = view in ("store", "both"), view in ("events", "both")
    instances = []
    for i, e in enumerate(engines):
        instance: dict = {"id": f"engine-{i}", "url": e.url, "model": model}
        if store and e.kvs_endpoint:
            instance["kvs_endpoints"] = [e.kvs_endpoint]
        if events and e.kv_events_endpoint:
            instance["kv_events_endpoint"] = e.kv_events_endpoint
            instance["kv_events_replay_endpoint"] = e.kv_events_replay_endpoint
        if e.max_model_len:
            instance["max_model_len"] = e.max_model_len
        instances.append(instance)
    config: dict = {
        "host": "127.0.0.1",
        "port": port,
        "workers": workers,
        "dispatch_policy": policy,
        "kvs_backend": "redis" if store else "kv_events",
        "instances": instances,
    }
    if store:
        config["kvs_redis_url"] = redis_url
    if tokenizer:
        config["tokenizer"] = tokenizer
    if cache_aware_min_tokens is not None:
        config["cache_aware_scheduling_min_tokens"] = cache_aware_min_tokens
    config.update(matching or {})
    return config


def cpu_split() -> tuple[set[int], set[int]] | None:
    """(router CPUs, everyone else's CPUs): a quarter of the CPUs, at least one, for the router.

    None on a single CPU, where there is nothing to split.
    """
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    share = max(1, len(cpus) // 4)
    return set(cpus[:share]), set(cpus[share:])


@contextlib.contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Run this process, and every process it starts meanwhile, on `cpus` (None: unchanged)."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


@contextlib.contextmanager
def router(target: Target, engines: Sequence[Engine], env: peers.PeerEnvironment, redis_url: str,
           tokenizer: str, log_dir: Path, phase: str, cpus: set[int] | None = None,
           model: str = MODEL, matching: dict | None = None) -> Iterator[RouterProcess]:
    """The target in front of `engines`, on `cpus` if given."""
    if target.router == DIRECT:
        yield RouterProcess(engines[0].url, None)
        return
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    slug = f"{target.router}-{target.policy}-{target.view}-w{target.workers}-{phase}"
    if target.router == KVGATE:
        config_path = log_dir / f"{slug}.yaml"
        min_tokens = OVERHEAD_CACHE_AWARE_MIN_TOKENS if phase == "overhead" else None
        config = kvgate_config(target.policy, port, engines, redis_url, tokenizer, target.workers, min_tokens,
                               target.view, model, matching)
        config_path.write_text(yaml.safe_dump(config))
        argv = _kvgate_cli("serve", "--config", str(config_path), "--log-level", "WARNING")
    else:
        build = peers.PEER_COMMANDS[target.router]
        argv = build(env, port=port, metrics_port=free_port(), worker_urls=[e.url for e in engines],
                     policy=target.policy)
    if cpus is not None:
        argv = ["taskset", "--cpu-list", ",".join(map(str, sorted(cpus))), *argv]
    with _processes([(argv, log_dir / f"{slug}.log", url, target.label)]) as (process,):
        yield RouterProcess(url, process.pid)
