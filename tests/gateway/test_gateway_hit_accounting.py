"""Closed-loop hit accounting: the prefix hit predicted at routing against the engine's usage report,
through real mock engines, and the usage chunk the gateway asks for on a client's behalf."""

from __future__ import annotations

import logging

import aiohttp
import openai
import orjson
import pytest

from kvgate.config.settings import Settings
from kvgate.gateway.feedback.hit_accounting import KEYS_DIFFER, STORE_CLAIMS, UNREPORTED, HitAccounting
from kvgate.gateway.feedback.usage import ReportedUsage, UsageTap
from kvgate.metrics.definitions import hit_metrics
from tests.gateway_helpers import EmbeddedFleet, assert_nothing_in_flight, counter_value
from tests.openai_helpers import openai_client

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MODEL = "kvgate/mock-llm"
CHUNK = 16
# Four full blocks and a partial one: a repeat finds 64 tokens cached.
PROMPT = list(range(1000, 1070))
GATEWAY_SETTINGS = Settings(port=0, kvs_chunk_size=CHUNK, dispatch_policy="cache_aware",
                            cache_aware_scheduling_min_tokens=0, health_check_interval_s=60.0,
                            stats_poll_interval_s=60.0)
ENGINE = Settings(kvs_chunk_size=CHUNK)


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


def comparisons(fleet: EmbeddedFleet, instance: str, outcome: str) -> float:
    return counter_value(fleet.gateway, "kvgate_hit_comparisons_total", instance=instance, outcome=outcome)


async def repeat(fleet: EmbeddedFleet, times: int, **extra) -> None:
    for _ in range(times):
        await client(fleet.gateway.url).completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, **extra)
        await fleet.flushed()


async def test_matching_keys_predict_what_the_engine_reports():
    async with EmbeddedFleet(GATEWAY_SETTINGS, {"e0": ENGINE}) as fleet:
        await repeat(fleet, 3)
        predicted = counter_value(fleet.gateway, "kvgate_predicted_cached_tokens_total", instance="e0")
        reported = counter_value(fleet.gateway, "kvgate_reported_cached_tokens_total", instance="e0")
        assert predicted == reported == 2 * 64
        assert comparisons(fleet, "e0", "agree") == 3
        assert counter_value(fleet.gateway, "kvgate_cached_tokens_disagreement_total", instance="e0") == 0
        await assert_nothing_in_flight(fleet.gateway)


@pytest.mark.parametrize("hashing", [{"hash_seed": "not-the-gateways"}, {"kvs_chunk_size": 2 * CHUNK}],
                         ids=["seed", "chunk-size"])
async def test_an_engine_hashing_otherwise_shows_disagreement_and_a_warning(caplog, hashing):
    engine = ENGINE.model_copy(update=hashing)
    async with EmbeddedFleet(GATEWAY_SETTINGS, {"e0": engine}) as fleet:
        with caplog.at_level(logging.WARNING, logger="kvgate.gateway.feedback.hit_accounting"):
            await repeat(fleet, 4)
            await repeat(fleet, 4)  # the same finding again within the interval: no second line
        assert counter_value(fleet.gateway, "kvgate_predicted_cached_tokens_total", instance="e0") == 0
        assert counter_value(fleet.gateway, "kvgate_reported_cached_tokens_total", instance="e0") == 7 * 64
        assert counter_value(fleet.gateway, "kvgate_cached_tokens_disagreement_total", instance="e0") == 7 * 64
        assert comparisons(fleet, "e0", "engine_higher") == 7
        warnings = [r.getMessage() for r in caplog.records if KEYS_DIFFER in r.getMessage()]
        assert len(warnings) == 1, caplog.text
        assert "instance e0" in warnings[0] and "keys differ" in warnings[0] and "hash_seed" in warnings[0]


async def test_a_stream_gets_usage_only_when_its_client_asked():
    async with EmbeddedFleet(GATEWAY_SETTINGS, {"e0": ENGINE}) as fleet:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
        async with (
            aiohttp.ClientSession() as session,
            session.post(fleet.gateway.url + "/v1/completions", json=body) as response,
        ):
            raw = await response.read()
        events = [e for e in raw.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and b"usage" not in raw
        assert all(orjson.loads(e[5:])["choices"] for e in events[:-1])
        # ...yet the engine's report was read: the comparison happened.
        assert comparisons(fleet, "e0", "agree") == 1
        await fleet.flushed()

        chunks = [c async for c in await client(fleet.gateway.url).completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, stream=True, stream_options={"include_usage": True})]
        assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens == len(PROMPT)
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 64
        assert comparisons(fleet, "e0", "agree") == 2
        await assert_nothing_in_flight(fleet.gateway)


def test_the_usage_tap_keeps_every_other_byte():
    usage = b'data: {"id":"x","choices":[],"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
    text = b'data: {"id":"x","choices":[{"index":0,"text":"a"}]}\r\n\r\n'
    tap = UsageTap(strip_usage_chunk=True)
    assert tap.events(text + usage + text) == text + text
    assert tap.usage == ReportedUsage(9, 4)
    kept = UsageTap(strip_usage_chunk=False)
    assert kept.end(text + usage + b"data: [DONE]\n\n") == text + usage + b"data: [DONE]\n\n"
    assert kept.answered and kept.usage == ReportedUsage(9, 4)
    no_details = UsageTap(strip_usage_chunk=False)
    no_details.whole(b'{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}')
    assert no_details.usage == ReportedUsage(3, None)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_each_cause_is_named_and_rate_limited(caplog):
    from prometheus_client import CollectorRegistry

    clock = FakeClock()
    hits = HitAccounting(hit_metrics(CollectorRegistry()), CHUNK, log_interval_s=60, clock=clock)
    with caplog.at_level(logging.WARNING, logger="kvgate.gateway.feedback.hit_accounting"):
        for _ in range(3):
            hits.record("a", 64, 64, ReportedUsage(70, 0), "r-a")
            hits.record("b", 64, 64, ReportedUsage(70, None), "r-b")
        for _ in range(3):  # within the interval: silent
            hits.record("a", 64, 64, ReportedUsage(70, 0), "r-a")
        clock.now = 61
        for _ in range(3):
            hits.record("a", 64, 64, ReportedUsage(70, 0), "r-a2")
    lines = [r.getMessage() for r in caplog.records]
    assert [STORE_CLAIMS in line for line in lines].count(True) == 2
    assert [UNREPORTED in line for line in lines].count(True) == 1
    assert any("--enable-prompt-tokens-details" in line and "instance b" in line for line in lines)
    assert "last request r-a2" in lines[-1]


def test_usage_is_asked_only_when_the_client_did_not():
    from kvgate.gateway.feedback.usage import stream_options_asking_usage
    from kvgate.gateway.protocol import parse_completion

    def asked(body: dict):
        return stream_options_asking_usage(parse_completion(orjson.dumps({"model": MODEL, "prompt": "x", **body})))

    assert asked({}) is None  # not a stream: the JSON answer always has usage
    assert asked({"stream": True}) == {"include_usage": True}
    assert asked({"stream": True, "stream_options": {"include_usage": True}}) is None
    # continuous_usage_stats did nothing without include_usage; sent along it would add usage to every chunk.
    assert asked({"stream": True, "stream_options": {"include_usage": False, "continuous_usage_stats": True}}) == \
        {"include_usage": True}


def test_a_missing_cached_count_is_zero_once_the_engine_has_reported_one():
    """vLLM leaves prompt_tokens_details out when nothing was cached, even with the flag on."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    hits = HitAccounting(hit_metrics(registry), CHUNK)

    def outcomes(outcome: str) -> float:
        return registry.get_sample_value("kvgate_hit_comparisons_total", {"instance": "a", "outcome": outcome}) or 0

    hits.record("a", 0, 0, ReportedUsage(70, None), "r1")  # a fresh engine: nothing known yet
    assert outcomes("unreported") == 1
    hits.record("a", 64, 64, ReportedUsage(70, 64), "r2")
    hits.record("a", 64, 64, ReportedUsage(70, None), "r3")  # now a zero
    assert (outcomes("agree"), outcomes("gateway_higher"), outcomes("unreported")) == (1, 1, 1)
