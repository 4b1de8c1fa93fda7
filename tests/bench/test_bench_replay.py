"""`kvgate bench replay` end to end: a tiny trace through a real gateway to two real mock engines.

The engines publish their cached blocks to the embedded index the gateway reads (cache_aware), so
requests sharing hash ids land where their prefix is cached. The client-side hit ratio must equal
what the engines themselves counted, and the prompt lengths must be the trace's, in both prompt
formats (token ids, and text for text-only routers).
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvgate.bench.replay import ReplayConfig, format_report, replay_trace
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.kvs_client import EmbeddedKVSIndex
from kvgate.mock_engine.publishers import PublisherOptions, open_publisher
from kvgate.mock_engine.server import MockEngineConfig, MockEngineHandle, start_mock_engine
from tests.gateway_helpers import tokenizer

pytestmark = pytest.mark.timeout(120)

MODEL = "kvgate/mock-llm"
# (timestamp ms, input length, hash ids): B, D share A's prefix, E shares C's.
TRACE = [
    (0, 1536, [1, 2, 3]),      # A
    (400, 1536, [1, 2, 4]),    # B: 1024 tokens of A
    (800, 1536, [7, 8, 9]),    # C
    (1200, 1600, [1, 2, 3, 10]),  # D: all 1536 of A
    (1600, 1536, [7, 8, 11]),  # E: 1024 tokens of C
]
EXPECTED_PROMPT_TOKENS = 1536 * 4 + 1600
EXPECTED_CACHED_TOKENS = 1024 + 1536 + 1024


@pytest.fixture
def trace_file(tmp_path: Path) -> str:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(
        json.dumps({"timestamp": t, "input_length": n, "output_length": 50, "hash_ids": ids}) + "\n"
        for t, n, ids in TRACE
    ))
    return str(path)


class Fleet:
    def __init__(self, gateway_url: str, engines: list[MockEngineHandle]) -> None:
        self.url = gateway_url
        self.engines = engines

    def engine_cached_tokens(self) -> int:
        return sum(e.engine.core.stats().prefix_cache_hits for e in self.engines)


@pytest.fixture
async def fleet() -> AsyncIterator[Fleet]:
    index = EmbeddedKVSIndex()
    settings = Settings(kvs_backend=KVSBackendName.EMBEDDED, dispatch_policy="cache_aware")
    engines = []
    for endpoint in ("127.0.0.2", "127.0.0.3"):
        publisher = await open_publisher(PublisherOptions("embedded", settings, local_ip=endpoint), index)
        engines.append(await start_mock_engine(MockEngineConfig(model=MODEL, time_scale=0.01, settings=settings),
                                               tokenizer=TokenizerService(tokenizer()), publisher=publisher))
    instances = tuple(InstanceConfig(id=f"e{i}", url=e.url, model=MODEL, kvs_endpoints=(ip,))
                      for i, (e, ip) in enumerate(zip(engines, ("127.0.0.2", "127.0.0.3"), strict=True)))
    gateway_settings = settings.model_copy(update={
        "port": 0, "instances": instances, "health_check_interval_s": 60.0, "stats_poll_interval_s": 60.0})
    gateway = await start_gateway(gateway_settings, kvs_index=index, tokenizer=tokenizer())
    try:
        yield Fleet(gateway.url, engines)
    finally:
        await gateway.close()
        for engine in engines:
            await engine.close()


async def test_replay_through_gateway_measures_what_engines_cached(fleet, trace_file):
    config = ReplayConfig(url=fleet.url, trace=trace_file, speedup=4, limit=None, max_tokens_cap=4,
                          timeout_s=30, progress=False)
    report = await replay_trace(config)
    s = report.summary
    assert (s.requests, s.completed, s.errors, s.missing_usage) == (5, 5, {}, 0)
    assert report.model == MODEL  # found through /v1/models
    assert s.prompt_tokens == EXPECTED_PROMPT_TOKENS
    assert s.cached_tokens == fleet.engine_cached_tokens() == EXPECTED_CACHED_TOKENS
    assert s.hit_ratio == pytest.approx(EXPECTED_CACHED_TOKENS / EXPECTED_PROMPT_TOKENS)
    # Cache-aware routing with caches that evict nothing reaches the trace's bound exactly.
    assert report.ideal_hit_ratio == pytest.approx(s.hit_ratio)
    assert s.ttft.count == len(report.ttfts_s) == 5
    assert s.output_tokens_per_s == pytest.approx(5 * 4 / s.duration_s)
    table = format_report(report)
    assert "5 / 5" in table and f"{s.hit_ratio:.1%}" in table


async def test_replay_cli_text_prompts_json(fleet, trace_file):
    # The CLI in a process of its own (as a user runs it), text prompts tokenized by the engines.
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "bench", "replay", "--gateway", fleet.url, "--trace", trace_file,
        "--speedup", "4", "--max-tokens-cap", "4", "--prompt-format", "text", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=90)
    assert process.returncode == 0, stderr.decode()
    result = json.loads(stdout)
    assert result["completed"] == 5 and result["errors"] == {}
    # One word per trace token: the engines' tokenizer sees exactly the trace's lengths.
    assert result["prompt_tokens"] == EXPECTED_PROMPT_TOKENS
    assert result["cached_tokens"] == fleet.engine_cached_tokens() == EXPECTED_CACHED_TOKENS
    assert result["config"]["prompt_format"] == "text"


async def test_replay_cli_reports_a_bad_trace(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvgate.cli", "bench", "replay", "--gateway", "http://127.0.0.1:9",
        "--trace", str(bad), "--model", MODEL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    _, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode == 1
    assert "bad.jsonl:1: missing field 'input_length'" in stderr.decode()
