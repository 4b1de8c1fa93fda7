"""`kvgate bench routers`: its flags and its run (see the package doc)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from tabulate import tabulate

from kvgate.bench import peers
from kvgate.bench.loadgen import OVERHEAD_PROMPT
from kvgate.bench.routers import phases
from kvgate.bench.routers.report import plot, results_json, table_rows
from kvgate.bench.routers.targets import (
    DEFAULT_TARGETS,
    DIRECT,
    ENGINE_BLOCK_TOKENS,
    ENGINE_KINDS,
    VLLM_CACHE_BLOCKS,
    VLLM_ENGINES,
    VLLM_MAX_MODEL_LEN,
    RoutersConfig,
    Target,
)
from kvgate.bench.routers.trace_slice import TraceSlice, write_slice
from kvgate.engines.install import EnginesMissing
from kvgate.processes import ServiceStartError
from kvgate.simulator.trace import TraceError

_DESCRIPTION = sys.modules["kvgate.bench.routers"].__doc__

def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "routers",
        help="kvgate vs sglang-router vs vllm-router: trace replay (hit ratio, TTFT) and overhead",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = RoutersConfig(trace="")
    parser.add_argument("--trace", required=True, help="Mooncake-format JSON-lines trace")
    parser.add_argument("--engines", type=int, default=None,
                        help=f"engines (default {d.engines} mock engines, {VLLM_ENGINES} real ones)")
    parser.add_argument("--engines-kind", choices=ENGINE_KINDS, default=d.engines_kind,
                        help="mock: `kvgate mock-engine` processes with a Redis store index; vllm: real vLLM "
                        "engines serving the tiny model (`kvgate engines install vllm`), KV events only, no store")
    parser.add_argument("--cache-capacity-blocks", type=int, default=None,
                        help=f"KV blocks of {ENGINE_BLOCK_TOKENS} tokens in each engine's own cache (default "
                        f"{d.cache_capacity_blocks}, an 80 GB GPU's HBM; real engines {VLLM_CACHE_BLOCKS})")
    parser.add_argument("--store-segment-blocks", type=int, default=d.store_segment_blocks,
                        help=f"mock engines: blocks of each one's DRAM store segment behind its cache, listed "
                        f"in the store index (default {d.store_segment_blocks}; 0: the index mirrors the cache)")
    parser.add_argument("--max-prompt-tokens", type=int, default=None,
                        help="cut every trace prompt to its first N tokens (default: whole prompts; real "
                        f"engines: whole KV blocks within their {VLLM_MAX_MODEL_LEN}-token context less "
                        "--max-tokens-cap)")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help=f"engines' real seconds per modelled GPU second (default {d.time_scale})")
    parser.add_argument("--speedup", type=float, default=d.speedup, help=f"trace time compression (default {d.speedup})")
    parser.add_argument("--limit", type=int, default=d.limit, help=f"first N trace requests (default {d.limit})")
    parser.add_argument("--max-tokens-cap", type=int, default=d.max_tokens_cap,
                        help=f"cap on each request's output tokens (default {d.max_tokens_cap})")
    parser.add_argument("--tokenizer", default="", help="engines' and kvgate's tokenizer (default: kvgate's)")
    parser.add_argument("--overhead-duration", type=float, default=d.overhead_duration_s,
                        help=f"seconds per overhead loop (default {d.overhead_duration_s})")
    parser.add_argument("--overhead-concurrency", default=",".join(map(str, d.overhead_concurrency)),
                        help="comma-separated concurrency levels of the overhead phase")
    parser.add_argument("--targets", default=",".join(
        t.router if t.router == DIRECT else f"{t.router}:{t.policy}" for t in DEFAULT_TARGETS),
        help="comma-separated router:policy list (direct = one backend, the overhead baseline); kvgate "
        "targets may name their cache view: kvgate:cache_aware@store (the default; with --engines-kind vllm "
        "@events), @events or @both")
    parser.add_argument("--workers", default="1",
                        help="comma-separated `kvgate serve --workers` counts; each kvgate target runs once per count")
    parser.add_argument("--venv", type=Path, default=None,
                        help=f"peers' virtualenv (default {peers.default_venv_dir()})")
    parser.add_argument("--no-install", action="store_true", help="use the peers' virtualenv as it is")
    parser.add_argument("--no-pin", action="store_true",
                        help="replay without giving the router its own core (see the module doc)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every process's log here")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures to this JSON file")
    parser.add_argument("--plot", type=Path, default=None, help="write the TTFT CDF and overhead bars (PNG)")
    parser.set_defaults(func=run)


def config_from(args: argparse.Namespace) -> RoutersConfig:
    workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    if not workers or min(workers) < 1:
        raise ValueError("--workers needs positive counts, e.g. 1,2")
    real = args.engines_kind == "vllm"
    # Real engines have no store: a kvgate target that names no view routes on their KV events.
    default_view = "events" if real else "store"
    targets = tuple(expanded for t in args.targets.split(",") if t.strip()
                    for expanded in Target.parse(t.strip(), default_view).with_workers(workers))
    concurrency = tuple(int(c) for c in args.overhead_concurrency.split(",") if c.strip())
    if not targets or not concurrency or min(concurrency) < 1:
        raise ValueError("--targets and --overhead-concurrency need at least one entry; concurrency >= 1")
    engines = args.engines if args.engines is not None else VLLM_ENGINES if real else RoutersConfig.engines
    cache_blocks = (args.cache_capacity_blocks if args.cache_capacity_blocks is not None
                    else VLLM_CACHE_BLOCKS if real else RoutersConfig.cache_capacity_blocks)
    if engines < 1 or args.limit < 1 or args.speedup <= 0 or args.time_scale < 0 or cache_blocks < 1:
        raise ValueError("--engines, --limit and --cache-capacity-blocks must be >= 1, --speedup > 0, "
                         "--time-scale >= 0")
    if args.store_segment_blocks < 0:
        raise ValueError("--store-segment-blocks must be >= 0")
    max_prompt_tokens = args.max_prompt_tokens
    if real:
        # No store behind real engines: a target routing on the store index could not run.
        store_targets = [t.label for t in targets if t.reads_store]
        if store_targets:
            raise ValueError(f"--engines-kind vllm has no store, so no store view: {', '.join(store_targets)} "
                             "cannot run; give kvgate targets @events (e.g. kvgate:cache_aware@events)")
        if engines > 8:
            raise ValueError("--engines-kind vllm: at most 8 engines (one core each, alternating)")
        context = VLLM_MAX_MODEL_LEN - args.max_tokens_cap
        # Default: the longest whole number of KV blocks that leaves room for the capped output.
        default = context // ENGINE_BLOCK_TOKENS * ENGINE_BLOCK_TOKENS
        max_prompt_tokens = default if max_prompt_tokens is None else max_prompt_tokens
        if max_prompt_tokens > context:
            raise ValueError(f"--max-prompt-tokens {max_prompt_tokens} + --max-tokens-cap {args.max_tokens_cap} "
                             f"exceed the real engines' context ({VLLM_MAX_MODEL_LEN} tokens)")
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError("--max-prompt-tokens must be >= 1")
    return RoutersConfig(
        trace=args.trace, engines=engines, cache_capacity_blocks=cache_blocks,
        store_segment_blocks=0 if real else args.store_segment_blocks, engines_kind=args.engines_kind,
        max_prompt_tokens=max_prompt_tokens,
        time_scale=args.time_scale, speedup=args.speedup, pin_cpus=not args.no_pin,
        limit=args.limit, max_tokens_cap=args.max_tokens_cap, tokenizer=args.tokenizer,
        overhead_concurrency=concurrency, overhead_duration_s=args.overhead_duration, targets=targets,
        venv_dir=args.venv, install_peers=not args.no_install, log_dir=args.log_dir,
    )


def fleet_line(config: RoutersConfig, trace: TraceSlice) -> str:
    """What the engines were and what they were sent, for the line under the table."""
    if config.engines_kind == "vllm":
        fleet = (f"{config.engines} real vLLM engines ({config.model}, {config.cache_capacity_blocks} KV blocks of "
                 f"{ENGINE_BLOCK_TOKENS} tokens each, KV events, no store)")
    else:
        fleet = (f"{config.engines} mock engines (time scale {config.time_scale}; each {config.cache_capacity_blocks} "
                 f"KV blocks of {ENGINE_BLOCK_TOKENS} tokens in its cache, {config.store_segment_blocks} in its "
                 "store segment)")
    cut = (f", prompts cut to their first {config.max_prompt_tokens} tokens ({trace.cut} of {len(trace.requests)} "
           f"were longer)" if config.max_prompt_tokens else "")
    return (f"{fleet}; trace {Path(config.trace).name} first {len(trace.requests)} requests at {config.speedup}x"
            f"{cut}, {trace.prompt_tokens:,} prompt tokens, ideal hit ratio (one infinite shared cache) "
            f"{trace.ideal_hit_ratio:.1%}, output capped at {config.max_tokens_cap} tokens")


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"kvgate bench routers: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        if config.log_dir:
            config.log_dir.mkdir(parents=True, exist_ok=True)
            log_dir = config.log_dir
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-routers-")))
        try:
            trace = write_slice(config.trace, config.limit, config.max_prompt_tokens, ENGINE_BLOCK_TOKENS, log_dir)
        except TraceError as exc:  # an absent file too, before anything starts
            print(f"kvgate bench routers: {exc}", file=sys.stderr)
            return 2
        try:
            results = phases.run_targets(config, trace, log_dir)
        except (EnginesMissing, ServiceStartError) as exc:  # real engines that cannot start
            print(f"kvgate bench routers: {exc}", file=sys.stderr)
            return 1
    headers, rows = table_rows(results, config.overhead_concurrency)
    print(tabulate(rows, headers=headers, tablefmt="github"))
    print(f"\n{fleet_line(config, trace)}; overhead: {len(OVERHEAD_PROMPT)} B prompt, max_tokens 1, "
          f"{config.overhead_duration_s:g} s per loop; run took {time.monotonic() - started:.0f} s")
    loads = [r.load_average[0] for r in results if r.load_average]
    if loads:
        print(f"1-minute load average after each target: {min(loads):.2f} .. {max(loads):.2f} "
              f"on {os.cpu_count()} CPUs (other work on the machine moves every figure)")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results_json(config, results), indent=2))
    if args.plot:
        plot(results, config.overhead_concurrency, args.plot)
    return 0 if any(r.status == "ok" for r in results) else 1
