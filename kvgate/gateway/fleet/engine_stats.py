"""Scrape each instance's Prometheus /metrics into the load account (vLLM and SGLang names).

The account counts what the gateway dispatched; the engine knows what it really runs and queues.
Merging both (REFERENCE.md section 8) keeps the load view right when other clients share the engine.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time
from collections.abc import Callable

import aiohttp
from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.log_throttle import LogThrottle
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.types import EngineStats

log = logging.getLogger(__name__)

_RUNNING = ("vllm:num_requests_running", "sglang:num_running_reqs")
_WAITING = ("vllm:num_requests_waiting", "sglang:num_queue_reqs")
# vLLM's "perc" gauge is a 0..1 ratio despite its name; older vLLM names it gpu_cache_usage_perc.
_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage")
_WANTED = _RUNNING + _WAITING + _USAGE
# More requests than any engine holds: a larger gauge is a bug, not a load.
MAX_GAUGE = 1e9
_METRIC_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")


def parse_engine_stats(text: str, on_refused: Callable[[str], None] | None = None) -> EngineStats | None:
    """Running/waiting summed over label sets (one per model or data-parallel rank), usage the maximum.

    None when the text has neither a running nor a waiting gauge: not an engine we know. A sample
    that no engine can mean (negative, NaN, infinite, a count beyond MAX_GAUGE) is left out and
    named to `on_refused`; usage is clamped to 0..1.
    """
    # vLLM's /metrics is ~100 KB of histograms; parsing only our few lines keeps the scrape cheap.
    wanted = "\n".join(line for line in text.splitlines() if _sample_name(line) in _WANTED)
    totals: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(wanted):
            for sample in family.samples:
                value = sample.value
                if not math.isfinite(value) or not 0 <= value <= MAX_GAUGE:
                    if on_refused is not None:
                        on_refused(sample.name)
                    continue
                if sample.name in _USAGE:
                    totals["usage"] = max(totals.get("usage", 0.0), min(value, 1.0))
                elif sample.name in _RUNNING:
                    totals["running"] = totals.get("running", 0.0) + value
                elif sample.name in _WAITING:
                    totals["waiting"] = totals.get("waiting", 0.0) + value
    except ValueError:
        return None
    if "running" not in totals and "waiting" not in totals:
        return None
    return EngineStats(
        num_running=int(min(totals.get("running", 0), MAX_GAUGE)),
        num_waiting=int(min(totals.get("waiting", 0), MAX_GAUGE)),
        kv_cache_usage_ratio=float(totals.get("usage", 0.0)),
    )


def _sample_name(line: str) -> str:
    match = _METRIC_NAME.match(line)  # comment lines ("# TYPE ...") do not match
    return match.group() if match else ""


class EngineStatsPoller:
    def __init__(
        self,
        registry: InstanceRegistry,
        session: aiohttp.ClientSession,
        account: LoadAccount,
        timeout_s: float,
        refused: Counter | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._registry = registry
        self._session = session
        self._account = account
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._clock = clock
        self._refused = refused  # by field: the metric name of a sample left out
        self._refusals = LogThrottle(log)

    async def poll_all(self) -> None:
        await asyncio.gather(*(self._poll(state.id, state.config.url) for state in self._registry.states()))

    async def _poll(self, instance_id: str, base_url: str) -> None:
        try:
            async with self._session.get(base_url.rstrip("/") + "/metrics", timeout=self._timeout) as response:
                if response.status != 200:
                    return
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError):
            return  # the health checker owns reporting unreachable instances
        stats = parse_engine_stats(text, lambda name: self._note_refused(instance_id, name))
        if stats is not None and self._registry.get(instance_id) is not None:
            self._account.observe_engine(instance_id, stats, self._clock())

    def _note_refused(self, instance_id: str, name: str) -> None:
        if self._refused is not None:
            self._refused.labels(name).inc()
        self._refusals.warning("instance %s: /metrics sample %s is not a possible value; left out", instance_id, name)
