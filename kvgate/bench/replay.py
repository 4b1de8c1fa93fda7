"""`kvgate bench replay`: send a Mooncake trace, time-compressed, through a running endpoint.

Figures as a client sees them: time to first token (streaming), the prefix-cache hit ratio
(token-weighted, from `usage.prompt_tokens_details.cached_tokens`), errors by kind, throughput.
The endpoint is anything OpenAI-compatible: the kvgate gateway, a peer router, one engine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
import orjson
from tabulate import tabulate

from kvgate.bench.loadgen import ReplaySummary, ScheduledRequest, replay, run_async, summarize_replay
from kvgate.bench.workload import TextRendering, build_requests, completion_body
from kvgate.config.settings import Settings
from kvgate.simulator.trace import TraceError, TraceRequest, ideal_hit_ratio, read_trace

PROMPT_FORMATS = ("tokens", "text")


@dataclass(frozen=True)
class ReplayConfig:
    url: str  # base URL of the endpoint, e.g. http://127.0.0.1:8000
    trace: str
    speedup: float = 4.0
    limit: int | None = 500
    duration_s: float | None = None
    max_tokens_cap: int | None = None
    concurrency_limit: int | None = None
    model: str | None = None  # None: the first model the endpoint lists
    prompt_format: str = "tokens"
    tokenizer: str = ""  # for prompt_format "text": the engines' tokenizer ("" = kvgate's default)
    # The engines' KV block size, for the hit ratio bound only: a mock engine's is its --kvs-chunk-size.
    engine_block_tokens: int = Settings().kvs_chunk_size
    timeout_s: float = 300.0
    progress: bool = True


@dataclass(frozen=True)
class ReplayReport:
    summary: ReplaySummary
    ttfts_s: tuple[float, ...]  # every completed request's TTFT, in send order (for CDFs)
    model: str
    ideal_hit_ratio: float  # the replayed window's bound: one infinite cache shared by all engines

    def to_dict(self) -> dict:
        return {"model": self.model, "ideal_hit_ratio": self.ideal_hit_ratio, **self.summary.to_dict()}


async def _first_model(base_url: str) -> str:
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.get(f"{base_url}/v1/models") as response:
        if response.status != 200:
            raise RuntimeError(f"GET {base_url}/v1/models answered {response.status}; pass --model")
        data = (await response.json()).get("data") or []
        if not data:
            raise RuntimeError(f"{base_url}/v1/models lists no model; pass --model")
        return str(data[0]["id"])


def _scheduled_requests(config: ReplayConfig, model: str, records: list[TraceRequest]) -> list[ScheduledRequest]:
    requests = build_requests(records, speedup=config.speedup, max_tokens_cap=config.max_tokens_cap)
    rendering = None
    if config.prompt_format == "text":
        from kvgate.gateway.planning.tokenizer import load_tokenizer

        rendering = TextRendering.from_tokenizer(load_tokenizer(config.tokenizer))
    scheduled = []
    for request, record in zip(requests, records, strict=True):
        prompt = rendering.prompt(record) if rendering else None
        body = orjson.dumps(completion_body(request, model, prompt))
        scheduled.append(ScheduledRequest(request.index, request.send_at_s, body))
    return scheduled


async def replay_trace(config: ReplayConfig) -> ReplayReport:
    base_url = config.url.rstrip("/")
    model = config.model or await _first_model(base_url)
    records = read_trace(config.trace, limit=config.limit, duration_s=config.duration_s)
    scheduled = _scheduled_requests(config, model, records)
    progress = None
    if config.progress:
        from tqdm import tqdm

        progress = tqdm(total=len(scheduled), unit="req", desc="replay", file=sys.stderr)
    started = time.perf_counter()
    try:
        outcomes = await replay(
            f"{base_url}/v1/completions",
            scheduled,
            concurrency_limit=config.concurrency_limit,
            timeout_s=config.timeout_s,
            on_done=(lambda _: progress.update()) if progress is not None else None,
        )
    finally:
        if progress is not None:
            progress.close()
    duration = time.perf_counter() - started
    ttfts = tuple(o.ttft_s for o in outcomes if o.ok and o.ttft_s is not None)
    bound = ideal_hit_ratio(records, engine_block_tokens=config.engine_block_tokens)
    return ReplayReport(summarize_replay(outcomes, duration), ttfts, model, bound)


def replay_in_process(config: ReplayConfig) -> ReplayReport:
    """Entry point for a separate process (see loadgen.in_own_process)."""
    return run_async(lambda: replay_trace(config))


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def format_report(report: ReplayReport) -> str:
    s = report.summary
    rows = [
        ("requests (completed / sent)", f"{s.completed} / {s.requests}"),
        ("errors", ", ".join(f"{k}: {v}" for k, v in s.errors.items()) or "none"),
        ("hit ratio (cached / prompt tokens)", "-" if s.hit_ratio is None else f"{s.hit_ratio:.1%}"),
        ("hit ratio bound (one infinite cache)", f"{report.ideal_hit_ratio:.1%}"),
        ("prompt tokens", f"{s.prompt_tokens:,}"),
        ("TTFT mean / p50 / p90 / p99 (ms)",
         " / ".join(_ms(getattr(s.ttft, k, None)) for k in ("mean", "p50", "p90", "p99"))),
        ("latency mean / p50 / p99 (ms)",
         " / ".join(_ms(getattr(s.latency, k, None)) for k in ("mean", "p50", "p99"))),
        ("throughput (req/s, output tok/s)", f"{s.requests_per_s:.2f}, {s.output_tokens_per_s:,.0f}"),
        ("duration (s)", f"{s.duration_s:.1f}"),
        ("latest send behind schedule (ms)", _ms(s.max_late_s)),
    ]
    if s.missing_usage:
        rows.append(("completed without usage", str(s.missing_usage)))
    return tabulate(rows, headers=("replay", report.model), tablefmt="simple")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "replay",
        help="replay a Mooncake trace through a running gateway and measure TTFT and hit ratio",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    defaults = ReplayConfig(url="", trace="")
    parser.add_argument("--gateway", required=True, help="base URL of the endpoint, e.g. http://127.0.0.1:8000")
    parser.add_argument("--trace", required=True, help="Mooncake-format JSON-lines trace")
    parser.add_argument("--speedup", type=float, default=defaults.speedup, help="time compression factor")
    parser.add_argument("--limit", type=int, default=defaults.limit, help="first N requests (0: no limit)")
    parser.add_argument("--duration", type=float, default=None,
                        help="only requests within this many seconds of trace time from the first")
    parser.add_argument("--max-tokens-cap", type=int, default=None, help="cap each request's output tokens")
    parser.add_argument("--concurrency-limit", type=int, default=None,
                        help="most requests in flight; later ones wait (the table shows how late)")
    parser.add_argument("--model", default=None, help="model name (default: the first of /v1/models)")
    parser.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=defaults.prompt_format,
                        help="token ids (no tokenizing anywhere) or text (each token one word of --tokenizer)")
    parser.add_argument("--tokenizer", default="", help="engines' tokenizer for --prompt-format text")
    parser.add_argument("--engine-block-tokens", type=int, default=defaults.engine_block_tokens,
                        help="the engines' KV block size in tokens, for the hit ratio bound (vLLM's --block-size, "
                        "SGLang's --page-size, kvgate mock-engine's --kvs-chunk-size)")
    parser.add_argument("--timeout", type=float, default=defaults.timeout_s, help="per-request timeout (s)")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.speedup <= 0 or (args.limit is not None and args.limit < 0):
        print("--speedup must be > 0 and --limit >= 0", file=sys.stderr)
        return 2
    if args.concurrency_limit is not None and args.concurrency_limit < 1:
        print("--concurrency-limit must be >= 1", file=sys.stderr)
        return 2
    if args.engine_block_tokens < 1:
        print("--engine-block-tokens must be >= 1", file=sys.stderr)
        return 2
    config = ReplayConfig(
        url=args.gateway,
        trace=args.trace,
        speedup=args.speedup,
        limit=args.limit or None,
        duration_s=args.duration,
        max_tokens_cap=args.max_tokens_cap,
        concurrency_limit=args.concurrency_limit,
        model=args.model,
        prompt_format=args.prompt_format,
        tokenizer=args.tokenizer,
        engine_block_tokens=args.engine_block_tokens,
        timeout_s=args.timeout,
        progress=not args.no_progress and not args.json,
    )
    try:
        report = run_async(lambda: replay_trace(config))
    except (TraceError, RuntimeError, aiohttp.ClientError) as exc:
        print(f"replay failed: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"config": asdict(config), **report.to_dict()}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.summary.completed else 1
