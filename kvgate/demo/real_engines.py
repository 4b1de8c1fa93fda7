"""The demo in front of real vLLM engines: the same workload, round robin then cache aware.

The engines start once (about a minute each, in parallel) and serve both runs; between runs their
prefix caches are emptied (`POST /reset_prefix_cache`, served with VLLM_SERVER_DEV_MODE=1), so both
runs start cold. The hit ratio in the table is the engines' own: the rise of
`vllm:prefix_cache_hits_total` over `vllm:prefix_cache_queries_total` during the run.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate.bench.workload import ReplayRequest
from kvgate.config.settings import InstanceConfig, Settings
from kvgate.demo.runner import POLICIES, PolicyRun, replay_through, scheduled_requests
from kvgate.engines.model import TINY_MODEL_NAME
from kvgate.engines.vllm import VLLMEngine, VLLMEngineSpec, fleet_hit_ratio, fleet_specs
from kvgate.gateway.http.server import start_gateway

# The bundled conversations' longest prompt is ~7,200 tokens.
MAX_MODEL_LEN = 8192


def engine_specs(model_dir: Path, count: int, cache_blocks: int) -> list[VLLMEngineSpec]:
    return fleet_specs(model_dir, TINY_MODEL_NAME, count, cache_blocks, MAX_MODEL_LEN)


def gateway_settings(engines: Sequence[VLLMEngine], policy: str, model_dir: Path) -> Settings:
    """Hashing as the engines hash, their KV events as the cache view."""
    spec = engines[0].spec
    return Settings(
        host="127.0.0.1",
        port=0,
        dispatch_policy=policy,
        tokenizer=str(model_dir),
        kvs_chunk_size=spec.block_size,
        hash_seed=spec.hash_seed,
        kvs_backend="kv_events",
        instances=[
            InstanceConfig(id=f"vllm-{i}", url=e.url, model=TINY_MODEL_NAME, max_model_len=e.spec.max_model_len,
                           kv_events_endpoint=e.spec.kv_events_endpoint,
                           kv_events_replay_endpoint=e.spec.kv_events_replay_endpoint)
            for i, e in enumerate(engines)
        ],
    )


async def run_real_demo(engines: Sequence[VLLMEngine], model_dir: Path, requests: Sequence[ReplayRequest],
                        tokenizer: Any, progress: bool = True) -> list[PolicyRun]:
    scheduled = scheduled_requests(requests, TINY_MODEL_NAME)
    runs = []
    for policy in POLICIES:
        for engine in engines:
            await asyncio.to_thread(engine.reset_prefix_cache)
        before = await asyncio.gather(*(asyncio.to_thread(e.prefix_cache_counters) for e in engines))
        gateway = await start_gateway(gateway_settings(engines, policy, model_dir), tokenizer=tokenizer)
        try:
            summary = await replay_through(gateway.url, scheduled, policy, progress, timeout_s=300.0)
        finally:
            await gateway.close()
        after = await asyncio.gather(*(asyncio.to_thread(e.prefix_cache_counters) for e in engines))
        ratio = fleet_hit_ratio(before, after)
        shown = "-" if ratio is None else f"{ratio:.1%}"
        runs.append(PolicyRun(policy, summary, {"engines' hit ratio (vllm:prefix_cache_hits / queries)": shown}))
    return runs
