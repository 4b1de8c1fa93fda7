"""Starting real engines for one test module, and reading what they report."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import aiohttp

from kvgate.engines.install import EngineVenv
from kvgate.engines.model import TINY_MODEL_NAME
from kvgate.engines.vllm import VLLMEngine, VLLMEngineSpec, parse_metric_sums, vllm_fleet

MODEL = TINY_MODEL_NAME
# Small enough that a test can fill it (24 blocks of 256 tokens), large enough for --max-model-len.
KV_BLOCKS = 24


@contextlib.contextmanager
def module_fleet(
    venv: EngineVenv, model_dir: Path, log_dir: Path, specs: Sequence[dict]
) -> Iterator[list[VLLMEngine]]:
    """Engines from keyword sets of VLLMEngineSpec, core i % 2 each, started together."""
    full = [
        VLLMEngineSpec(model_dir, MODEL, core=i % 2, extra_args=("--num-gpu-blocks-override", str(KV_BLOCKS)),
                       **spec)
        for i, spec in enumerate(specs)
    ]
    with vllm_fleet(full, venv, log_dir) as engines:
        yield engines


async def engine_metrics(engine: VLLMEngine) -> dict[str, float]:
    async with aiohttp.ClientSession() as session, session.get(engine.url + "/metrics") as response:
        return parse_metric_sums(await response.text())


async def engine_load(engine: VLLMEngine) -> int:
    """Requests the engine holds: running + waiting, as kvgate's scraper reads them."""
    metrics = await engine_metrics(engine)
    return int(metrics.get("vllm:num_requests_running", 0) + metrics.get("vllm:num_requests_waiting", 0))


async def wait_engines_hold(engines: Sequence[VLLMEngine], count: int, timeout_s: float = 15.0) -> list[int]:
    """Each engine's requests (running + waiting) once they sum to `count`: the engines' gauges follow
    their scheduler steps, a moment after a request's first token reached the client."""
    deadline = time.monotonic() + timeout_s
    while True:
        held = [await engine_load(engine) for engine in engines]
        if sum(held) == count:
            return held
        if time.monotonic() > deadline:
            raise AssertionError(f"the engines hold {held} requests, not {count} in all, after {timeout_s}s")
        await _sleep(0.2)


async def wait_engine_idle(engine: VLLMEngine, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while await engine_load(engine):
        if time.monotonic() > deadline:
            raise AssertionError(f"engine {engine.url} still holds requests after {timeout_s}s")
        await _sleep(0.1)


async def _sleep(seconds: float) -> None:
    import asyncio

    await asyncio.sleep(seconds)


async def engine_sample(engine: VLLMEngine, name: str, **labels: str) -> float:
    """One sample of the engine's metrics, summed over the label sets that match `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    async with aiohttp.ClientSession() as session, session.get(engine.url + "/metrics") as response:
        text = await response.text()
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()))
