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
from kvgate.bench.routers.targets import DEFAULT_TARGETS, DIRECT, ENGINE_BLOCK_TOKENS, RoutersConfig, Target
from kvgate.simulator.trace import TraceError, ideal_hit_ratio, read_trace

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
    parser.add_argument("--engines", type=int, default=d.engines, help=f"mock engines (default {d.engines})")
    parser.add_argument("--cache-capacity-blocks", type=int, default=d.cache_capacity_blocks,
                        help=f"KV blocks of {ENGINE_BLOCK_TOKENS} tokens per engine (default {d.cache_capacity_blocks}, ~3.4M tokens)")
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
        help="comma-separated router:policy list (direct = one backend, the overhead baseline)")
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


def _config_from(args: argparse.Namespace) -> RoutersConfig:
    workers = tuple(int(w) for w in args.workers.split(",") if w.strip())
    if not workers or min(workers) < 1:
        raise ValueError("--workers needs positive counts, e.g. 1,2")
    targets = tuple(expanded for t in args.targets.split(",") if t.strip()
                    for expanded in Target.parse(t.strip()).with_workers(workers))
    concurrency = tuple(int(c) for c in args.overhead_concurrency.split(",") if c.strip())
    if not targets or not concurrency or min(concurrency) < 1:
        raise ValueError("--targets and --overhead-concurrency need at least one entry; concurrency >= 1")
    if args.engines < 1 or args.limit < 1 or args.speedup <= 0 or args.time_scale < 0 or args.cache_capacity_blocks < 1:
        raise ValueError("--engines, --limit and --cache-capacity-blocks must be >= 1, --speedup > 0, "
                         "--time-scale >= 0")
    return RoutersConfig(
        trace=args.trace, engines=args.engines, cache_capacity_blocks=args.cache_capacity_blocks,
        time_scale=args.time_scale, speedup=args.speedup, pin_cpus=not args.no_pin,
        limit=args.limit, max_tokens_cap=args.max_tokens_cap, tokenizer=args.tokenizer,
        overhead_concurrency=concurrency, overhead_duration_s=args.overhead_duration, targets=targets,
        venv_dir=args.venv, install_peers=not args.no_install, log_dir=args.log_dir,
    )


def run(args: argparse.Namespace) -> int:
    try:
        config = _config_from(args)
    except ValueError as exc:
        print(f"kvgate bench routers: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    try:
        records = read_trace(config.trace, limit=config.limit)
    except TraceError as exc:  # an absent file too, before anything starts
        print(f"kvgate bench routers: {exc}", file=sys.stderr)
        return 2
    bound = ideal_hit_ratio(records, engine_block_tokens=ENGINE_BLOCK_TOKENS)
    with contextlib.ExitStack() as stack:
        if config.log_dir:
            config.log_dir.mkdir(parents=True, exist_ok=True)
            log_dir = config.log_dir
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-routers-")))
        results = phases.run_targets(config, log_dir)
    headers, rows = table_rows(results, config.overhead_concurrency)
    print(tabulate(rows, headers=headers, tablefmt="github"))
    print(f"\n{config.engines} mock engines (time scale {config.time_scale}), trace {Path(config.trace).name} "
          f"first {config.limit} requests at {config.speedup}x (hit ratio bound {bound:.1%}), output capped at "
          f"{config.max_tokens_cap} tokens, {config.cache_capacity_blocks} KV blocks of {ENGINE_BLOCK_TOKENS} tokens per engine; "
          f"overhead: {len(OVERHEAD_PROMPT)} B prompt, max_tokens 1, {config.overhead_duration_s:.0f} s per "
          f"loop; run took {time.monotonic() - started:.0f} s")
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
