"""Latency statistics and the load drivers against a real aiohttp server on loopback."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web

from kvgate.bench.loadgen import (
    LatencyStats,
    ScheduledRequest,
    closed_loop,
    percentile,
    replay,
    summarize_replay,
)


def test_percentile_interpolates_like_numpy():
    values = [1.0, 2.0, 3.0, 4.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == 2.5
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError):
        percentile([], 50)
    with pytest.raises(ValueError):
        percentile(values, 101)


def test_latency_stats():
    stats = LatencyStats.of([0.3, 0.1, 0.2])
    assert stats == LatencyStats(count=3, mean=pytest.approx(0.2), p50=0.2, p90=pytest.approx(0.28),
                                 p99=pytest.approx(0.298), max=0.3)
    assert LatencyStats.of([]) is None


async def sse_app_runner(port_holder: list) -> web.AppRunner:
    """A server with one behaviour per prompt: ok (usage with cached tokens), 429, cut stream, error event."""

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        kind = body["prompt"]
        if kind == "busy":
            return web.json_response({"error": {"message": "busy"}}, status=429)
        if kind == "plain":
            return web.json_response({"choices": [{"text": "x"}]})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        await asyncio.sleep(0.01)
        await response.write(b'data: {"choices": [{"index": 0, "text": "a"}]}\n\n')
        if kind == "cut":
            return response
        if kind == "error":
            await response.write(b'data: {"error": {"message": "boom"}}\n\n')
            return response
        usage = {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102}
        if kind == "cached":
            usage["prompt_tokens_details"] = {"cached_tokens": 60}
        await response.write(b'data: {"choices": [{"index": 0, "text": "b"}]}\n\n')
        await response.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port_holder.append(runner.addresses[0][1])
    return runner


async def test_replay_measures_ttft_hits_and_error_kinds():
    ports: list[int] = []
    runner = await sse_app_runner(ports)
    url = f"http://127.0.0.1:{ports[0]}/v1/completions"
    kinds = ["cached", "uncached", "busy", "cut", "error"]
    requests = [ScheduledRequest(i, 0.02 * i, json.dumps({"prompt": k}).encode()) for i, k in enumerate(kinds)]
    try:
        outcomes = await replay(url, requests, concurrency_limit=2, timeout_s=5)
    finally:
        await runner.cleanup()
    by_index = {o.index: o for o in outcomes}
    assert by_index[0].ok and by_index[0].cached_tokens == 60 and by_index[0].ttft_s >= 0.01
    assert by_index[1].ok and by_index[1].cached_tokens == 0
    assert by_index[2].error == "http_429"
    assert by_index[3].error == "truncated"
    assert by_index[4].error == "stream_error"
    summary = summarize_replay(outcomes, duration_s=2.0)
    assert summary.completed == 2 and summary.requests == 5
    assert summary.errors == {"http_429": 1, "stream_error": 1, "truncated": 1}
    assert summary.hit_ratio == pytest.approx(60 / 200)
    assert summary.ttft.count == 2 and summary.requests_per_s == 1.0
    assert summary.output_tokens_per_s == 2.0


async def test_replay_connection_refused_is_an_error_kind():
    requests = [ScheduledRequest(0, 0.0, b"{}")]
    outcomes = await replay("http://127.0.0.1:9/v1/completions", requests, timeout_s=2)
    assert outcomes[0].error == "connection"


async def test_closed_loop_is_bounded_and_counts():
    ports: list[int] = []
    runner = await sse_app_runner(ports)
    url = f"http://127.0.0.1:{ports[0]}/v1/completions"
    try:
        result = await closed_loop(url, b'{"prompt": "plain"}', concurrency=4, duration_s=0.3,
                                   max_requests=200, warmup_s=0.05)
        refused = await closed_loop(url, b'{"prompt": "busy"}', concurrency=1, duration_s=0.1,
                                    max_requests=5, warmup_s=0)
    finally:
        await runner.cleanup()
    assert 0 < result.requests <= 200 and not result.errors
    assert result.latency.count == result.requests == len(result.latencies_s)
    assert list(result.latencies_s) == sorted(result.latencies_s)
    assert refused.requests == 0 and refused.errors == {"http_429": 5}
    # Every answer the server sent is counted, of any status and warm-up included (CPU per answer).
    assert result.answers > result.requests and refused.answers == 5
