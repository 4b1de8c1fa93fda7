"""HTTP load drivers and the latency statistics every benchmark prints.

Two drivers, both measuring what a client sees:
- `replay`: open loop. Each request leaves at its scheduled time (a trace's arrival process),
  streams, and records time to first token, the usage block (prompt and cached tokens) and how it
  failed, if it did.
- `closed_loop`: N workers each send the same small request back to back for a bounded time;
  the latency distribution and the request rate show what a router adds on top of its backend.

Benchmarks run these in a process of their own (`in_own_process`), so the driver never shares an
event loop or a core's time slice with the server it measures any more than the OS makes it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from typing import Any, TypeVar

import aiohttp
import orjson

JSON_HEADERS = {"Content-Type": "application/json"}
# The overhead benchmarks' request: ~2 KB of English (~450 tokens), below the cache-aware threshold
# (1024 tokens) like the short chat turns that make up most of a router's request rate.
OVERHEAD_PROMPT = ("The gateway reads the request, picks an instance and relays the answer. " * 40)[:2048]
T = TypeVar("T")


# --- statistics -------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    position = (len(sorted_values) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(sorted_values) - 1)
    return sorted_values[low] + (sorted_values[high] - sorted_values[low]) * (position - low)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    """Seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencyStats | None:
        if not values:
            return None
        ordered = sorted(values)
        return cls(
            count=len(ordered),
            mean=math.fsum(ordered) / len(ordered),
            p50=percentile(ordered, 50),
            p90=percentile(ordered, 90),
            p99=percentile(ordered, 99),
            max=ordered[-1],
        )


# --- open-loop streaming replay -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    index: int
    send_at_s: float
    body: bytes  # pre-encoded so encoding never delays a send


@dataclass(slots=True)
class StreamOutcome:
    index: int
    error: str | None = None  # kind of failure, None when the stream finished with [DONE]
    ttft_s: float | None = None
    latency_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    late_s: float = 0.0  # how long after its scheduled time the request actually left

    @property
    def ok(self) -> bool:
        return self.error is None


def _apply_usage(outcome: StreamOutcome, usage: dict[str, Any]) -> None:
    outcome.prompt_tokens = usage.get("prompt_tokens")
    outcome.completion_tokens = usage.get("completion_tokens")
    details = usage.get("prompt_tokens_details") or {}
    # An engine that reports usage but no details computed every prompt token.
    outcome.cached_tokens = int(details.get("cached_tokens") or 0)


async def _read_stream(response: aiohttp.ClientResponse, outcome: StreamOutcome, started: float) -> None:
    done = False
    async for raw_line in response.content:
        line = raw_line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        try:
            event = orjson.loads(data)
        except orjson.JSONDecodeError:
            outcome.error = "bad_chunk"
            return
        if "error" in event:
            outcome.error = "stream_error"
            return
        if outcome.ttft_s is None and event.get("choices"):
            outcome.ttft_s = time.perf_counter() - started
        if event.get("usage"):
            _apply_usage(outcome, event["usage"])
    if not done:
        outcome.error = "truncated"
    elif outcome.ttft_s is None:
        outcome.error = "no_tokens"


async def stream_one(
    session: aiohttp.ClientSession, url: str, request: ScheduledRequest, timeout_s: float
) -> StreamOutcome:
    """Send one streaming completion; every failure becomes an error kind, never an exception."""
    outcome = StreamOutcome(request.index)
    started = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(url, data=request.body, headers=JSON_HEADERS) as response:
                if response.status != 200:
                    await response.read()
                    outcome.error = f"http_{response.status}"
                else:
                    await _read_stream(response, outcome, started)
    except TimeoutError:
        outcome.error = "timeout"
    except aiohttp.ClientConnectionError:
        outcome.error = "connection"
    except aiohttp.ClientError:
        outcome.error = "client_error"
    outcome.latency_s = time.perf_counter() - started
    return outcome


async def replay(
    url: str,
    requests: Sequence[ScheduledRequest],
    *,
    concurrency_limit: int | None = None,
    timeout_s: float = 300.0,
    on_done: Callable[[StreamOutcome], None] | None = None,
) -> list[StreamOutcome]:
    """Send each request at its `send_at_s` (open loop); `concurrency_limit` caps requests in flight.

    With a limit, a request whose time has come waits for a free slot, and `late_s` says how long.
    """
    limiter = asyncio.Semaphore(concurrency_limit) if concurrency_limit else None
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:
        start = time.perf_counter()

        async def send(request: ScheduledRequest) -> StreamOutcome:
            delay = request.send_at_s - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            if limiter is not None:
                await limiter.acquire()
            try:
                late = max(0.0, time.perf_counter() - start - request.send_at_s)
                outcome = await stream_one(session, url, request, timeout_s)
                outcome.late_s = late
            finally:
                if limiter is not None:
                    limiter.release()
            if on_done is not None:
                on_done(outcome)
            return outcome

        return list(await asyncio.gather(*(send(r) for r in requests)))


@dataclass(frozen=True, slots=True)
class ReplaySummary:
    requests: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int
    # Token-weighted: cached prompt tokens / prompt tokens, over completed requests that reported usage.
    hit_ratio: float | None
    missing_usage: int
    ttft: LatencyStats | None
    latency: LatencyStats | None
    max_late_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize_replay(outcomes: Sequence[StreamOutcome], duration_s: float) -> ReplaySummary:
    completed = [o for o in outcomes if o.ok]
    with_usage = [o for o in completed if o.prompt_tokens is not None]
    prompt_tokens = sum(o.prompt_tokens or 0 for o in with_usage)
    cached_tokens = sum(o.cached_tokens or 0 for o in with_usage)
    output_tokens = sum(o.completion_tokens or 0 for o in completed)
    return ReplaySummary(
        requests=len(outcomes),
        completed=len(completed),
        errors=dict(sorted(Counter(o.error for o in outcomes if o.error).items())),
        duration_s=duration_s,
        requests_per_s=len(completed) / duration_s if duration_s > 0 else 0.0,
        output_tokens_per_s=output_tokens / duration_s if duration_s > 0 else 0.0,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        hit_ratio=cached_tokens / prompt_tokens if prompt_tokens else None,
        missing_usage=len(completed) - len(with_usage),
        ttft=LatencyStats.of([o.ttft_s for o in completed if o.ttft_s is not None]),
        latency=LatencyStats.of([o.latency_s for o in completed if o.latency_s is not None]),
        max_late_s=max((o.late_s for o in outcomes), default=0.0),
    )


# --- closed-loop fixed request ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ClosedLoopResult:
    concurrency: int
    requests: int
    errors: dict[str, int]
    duration_s: float
    requests_per_s: float
    latency: LatencyStats | None
    # Sorted latencies of successful requests (seconds), for CDFs and differences between runs.
    latencies_s: tuple[float, ...] = field(repr=False, default=())
    # Every answer the target sent, of any status, warm-up included: the work its CPU time paid for.
    answers: int = 0


async def closed_loop(
    url: str,
    body: bytes,
    *,
    concurrency: int,
    duration_s: float,
    max_requests: int,
    warmup_s: float = 0.5,
    timeout_s: float = 10.0,
) -> ClosedLoopResult:
    """`concurrency` workers send `body` back to back for `warmup_s`, then for at most `duration_s`
    and `max_requests` more; only the requests sent after the warm-up (connections open, caches
    warm) are counted.
    """
    if concurrency < 1 or duration_s <= 0 or max_requests < 1:
        raise ValueError("concurrency and max_requests must be >= 1, duration_s > 0")
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    request_timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=request_timeout) as session:
        begin = time.perf_counter()
        measure_from = begin + warmup_s
        stop_at = measure_from + duration_s
        sent = answers = 0

        async def worker() -> None:
            nonlocal sent, answers
            while sent < max_requests and time.perf_counter() < stop_at:
                started = time.perf_counter()
                if started >= measure_from:
                    sent += 1
                error = None
                try:
                    async with session.post(url, data=body, headers=JSON_HEADERS) as response:
                        await response.read()
                        answers += 1
                        if response.status != 200:
                            error = f"http_{response.status}"
                except TimeoutError:
                    error = "timeout"
                except aiohttp.ClientError:
                    error = "connection"
                finished = time.perf_counter()
                if started < measure_from:
                    continue
                if error:
                    errors[error] += 1
                else:
                    latencies.append(finished - started)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = max(time.perf_counter() - measure_from, 1e-9)
    ordered = tuple(sorted(latencies))
    return ClosedLoopResult(
        concurrency=concurrency,
        requests=len(ordered),
        errors=dict(errors),
        duration_s=elapsed,
        requests_per_s=len(ordered) / elapsed,
        latency=LatencyStats.of(ordered),
        latencies_s=ordered,
        answers=answers,
    )


# --- process isolation ---------------------------------------------------------------------------


def run_async(coro_factory: Callable[[], Any]) -> Any:
    """asyncio.run on uvloop when it is installed (it is on Linux): a faster client skews less."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro_factory())
    return uvloop.run(coro_factory())


def in_own_process(function: Callable[..., T], *args: Any, timeout_s: float) -> T:
    """Run a picklable top-level `function(*args)` in a fresh process and return its result.

    The process is spawned, so it imports the caller's __main__ module again: a script calling
    this must keep its work under `if __name__ == "__main__":` (the kvgate command does).
    Past `timeout_s` the process is terminated (leaving the pool's context does it) and
    multiprocessing.TimeoutError is raised.
    """
    with get_context("spawn").Pool(processes=1) as pool:
        return pool.apply_async(function, args).get(timeout=timeout_s)


def closed_loop_in_process(url: str, body: bytes, concurrency: int, duration_s: float,
                           max_requests: int) -> ClosedLoopResult:
    """Entry point for a separate process (see in_own_process)."""
    return run_async(lambda: closed_loop(url, body, concurrency=concurrency, duration_s=duration_s,
                                         max_requests=max_requests))
