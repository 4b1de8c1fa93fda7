"""`kvgate demo`: round robin vs cache-aware routing on one machine, in one process.

Starts an embedded KV index (or, with --mooncake, the real Mooncake master; with --kvs-backend
kv_events no store, the gateway following each engine's KV events), N mock engines and the
gateway, replays a workload with shared prefixes twice (fresh engines each time), and prints the
two runs side by side.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator

from kvgate.bench.loadgen import run_async
from kvgate.bench.workload import ReplayRequest
from kvgate.config.settings import PDProtocol, Settings
from kvgate.demo.fleet import FleetSpec, KVEventsSpec
from kvgate.demo.prfaas import PrfaasDemo, run_prfaas_demo
from kvgate.demo.report import format_table
from kvgate.demo.runner import run_demo, trace_requests
from kvgate.demo.workload import ConversationWorkload, conversation_requests
from kvgate.engine_model import ServiceProfile
from kvgate.kvs_client.launch import MooncakeMasterProcess, start_mooncake_master
from kvgate.mock_engine.server import MockEngineConfig
from kvgate.processes import ServiceStartError
from kvgate.simulator.trace import TraceError

# 128 blocks of 256 tokens (32K tokens) per engine: the bundled workload's 8 documents (~32K tokens)
# plus the conversations on them outgrow one engine's cache but fit the fleet's. The engines are
# scaled down with the workload (a real GPU holds ~426K tokens and serves far more documents).
BUNDLED_CACHE_BLOCKS = 128
# Trace prompts are long (12K tokens on average): engines get a whole 80 GB GPU's cache.
TRACE_CACHE_BLOCKS = ServiceProfile().cache_capacity_blocks
KVS_BACKENDS = ("embedded", "mooncake", "kv_events")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="compare round robin and cache-aware routing on a simulated fleet",
        description=__doc__,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    workload = ConversationWorkload()
    parser.add_argument("--engines", type=_engines, default=4,
                        help="number of mock engines, or 'vllm' for real vLLM engines (--vllm-engines of them; "
                        "install with `kvgate engines install vllm`, docs/ENGINES.md)")
    parser.add_argument("--vllm-engines", type=int, default=2, help="with --engines vllm: how many (one core each)")
    parser.add_argument("--requests", type=int, default=workload.num_requests, help="requests per policy")
    parser.add_argument(
        "--duration",
        type=float,
        default=workload.duration_s,
        help="seconds over which the bundled workload's conversations arrive",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="replay the first --requests of this Mooncake-format trace instead of the "
        "bundled conversations, its arrival times multiplied by --time-scale",
    )
    parser.add_argument(
        "--max-tokens-cap",
        type=int,
        default=64,
        help="with --trace: cap each request's output tokens (spares the CPU)",
    )
    parser.add_argument(
        "--kvs-backend",
        choices=KVS_BACKENDS,
        default="embedded",
        help="what the gateway routes on: an embedded store index the engines publish to, the real "
        "Mooncake master, or the engines' KV events alone (each engine publishes vLLM's events on its "
        "own TCP ports, docs/KV_EVENTS.md; no store)",
    )
    parser.add_argument(
        "--mooncake",
        action="store_true",
        help="use the real Mooncake master as the KV store (starts mooncake_master); "
        "the same as --kvs-backend mooncake",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and of the engines' text")
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="real seconds per modelled GPU second (1: the modelled GPU's own speed)",
    )
    parser.add_argument(
        "--cache-capacity-blocks",
        type=int,
        default=None,
        help=f"KV cache of each engine in 256-token blocks (default {BUNDLED_CACHE_BLOCKS}, "
        f"{TRACE_CACHE_BLOCKS} with --trace)",
    )
    parser.add_argument(
        "--pd",
        action="store_true",
        help="a disaggregated fleet: the first half of --engines prefill, the rest decode",
    )
    parser.add_argument("--pd-protocol", choices=("sglang", "vllm"), default="vllm",
                        help="with --pd: the hand-off the engines and the gateway speak")
    parser.add_argument("--prfaas", action="store_true",
                        help="local PD (--engines) vs the same plus a remote Prefill-as-a-Service cluster of "
                        "--prfaas-engines prefill engines behind a modelled link (implies --pd)")
    parser.add_argument("--prfaas-engines", type=int, default=2, help="with --prfaas: remote prefill engines")
    parser.add_argument("--prfaas-egress-gbps", type=float, default=10.0,
                        help="with --prfaas: the link from the remote cluster, shared by its engines")
    parser.add_argument("--prfaas-kv-bytes-per-token", type=float, default=65536.0,
                        help="with --prfaas: KV bytes per prompt token (what crosses the link)")
    parser.add_argument("--prfaas-threshold-tokens", type=int, default=4096,
                        help="with --prfaas: prompts with more uncached tokens than this are prefilled remotely")
    # Mock engines load no prefix from another engine: a prefix "shipped" under an abundant link
    # would be recomputed, so the demo defaults to scarce, where no decision relies on shipping.
    parser.add_argument("--prfaas-bandwidth-mode", choices=("auto", "scarce", "abundant"), default="scarce",
                        help="with --prfaas: how cached prefixes in the two clusters are weighed")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def _engines(value: str) -> int | str:
    if value == "vllm":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of mock engines or 'vllm', got {value!r}") from None


def _requests(args: argparse.Namespace) -> list[ReplayRequest]:
    if args.trace:
        return trace_requests(args.trace, args.requests, args.time_scale, args.max_tokens_cap)
    return conversation_requests(
        ConversationWorkload(num_requests=args.requests, duration_s=args.duration, seed=args.seed)
    )


def _fleet(args: argparse.Namespace, master: MooncakeMasterProcess | None) -> FleetSpec:
    capacity = args.cache_capacity_blocks or (TRACE_CACHE_BLOCKS if args.trace else BUNDLED_CACHE_BLOCKS)
    engine = MockEngineConfig(
        seed=args.seed,
        time_scale=args.time_scale,
        profile=ServiceProfile(cache_capacity_blocks=capacity),
        settings=Settings(),
    )
    events_only = _kvs_backend(args) == "kv_events"
    return FleetSpec(args.engines, engine, master, PDProtocol(args.pd_protocol) if args.pd or args.prfaas else None,
                     kv_events=KVEventsSpec() if events_only else None, store=not events_only)


@contextlib.contextmanager
def _store(use_mooncake: bool) -> Iterator[MooncakeMasterProcess | None]:
    if not use_mooncake:
        yield None
        return
    # The in-process store clients log every setup step at INFO; keep their warnings and errors
    # (Mooncake reads MC_LOG_LEVEL, not glog's GLOG_minloglevel).
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
    with start_mooncake_master() as master:
        yield master


def _kvs_backend(args: argparse.Namespace) -> str:
    return "mooncake" if args.mooncake else args.kvs_backend


def _check(args: argparse.Namespace) -> str | None:
    if args.mooncake and args.kvs_backend not in ("embedded", "mooncake"):
        return "--mooncake is --kvs-backend mooncake: give one of them"
    if args.engines == "vllm":
        # Real engines are always followed through their KV events (real_engines.py).
        if args.pd or args.prfaas or _kvs_backend(args) == "mooncake":
            return "--engines vllm runs the plain comparison (no --pd, --prfaas or --mooncake)"
        if not 1 <= args.vllm_engines <= 8:
            return "--vllm-engines must be in 1..8"
        return None
    if args.engines < 1 or args.engines > 250:
        return "--engines must be in 1..250 (one loopback IP each)"
    if args.prfaas and _kvs_backend(args) == "kv_events":
        return "--prfaas compares on a store: --kvs-backend embedded or mooncake"
    if (args.pd or args.prfaas) and args.engines < 2:
        return "--pd and --prfaas need --engines 2 or more (a prefill and a decode engine at least)"
    if args.prfaas and (args.prfaas_engines < 1 or args.engines + args.prfaas_engines > 250
                        or args.prfaas_egress_gbps <= 0 or args.prfaas_kv_bytes_per_token <= 0
                        or args.prfaas_threshold_tokens < 0):
        return ("--prfaas-engines must be >= 1 (with --engines, at most 250), --prfaas-egress-gbps and "
                "--prfaas-kv-bytes-per-token > 0, --prfaas-threshold-tokens >= 0")
    if args.requests < 1 or args.duration <= 0 or args.time_scale <= 0:
        return "--requests must be >= 1, --duration and --time-scale > 0"
    if args.cache_capacity_blocks is not None and args.cache_capacity_blocks < 1:
        return "--cache-capacity-blocks must be >= 1"
    return None


def run(args: argparse.Namespace) -> int:
    problem = _check(args)
    if problem:
        print(problem, file=sys.stderr)
        return 2
    started = time.perf_counter()
    try:
        requests = _requests(args)
    except (TraceError, ValueError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 2
    if args.engines == "vllm":
        return _run_real(args, requests, started)
    from kvgate.gateway.planning.tokenizer import load_tokenizer

    tokenizer = load_tokenizer()  # the gateway's; the demo's prompts are token ids
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    store = {"embedded": "an embedded index", "mooncake": "the Mooncake master",
             "kv_events": "none, the engines' KV events alone"}[_kvs_backend(args)]
    fleet = (f"{args.engines} mock engines ({args.engines // 2} prefill + {args.engines - args.engines // 2} decode, "
             f"{args.pd_protocol} hand-off)" if args.pd or args.prfaas else f"{args.engines} mock engines")
    if args.prfaas:
        fleet += (f", then {args.prfaas_engines} remote prefill engines behind a {args.prfaas_egress_gbps:g} Gbps "
                  f"link ({args.prfaas_kv_bytes_per_token:,.0f} B of KV per token, threshold "
                  f"{args.prfaas_threshold_tokens} tokens)")
    print(
        f"kvgate demo: {len(requests)} requests ({prompt_tokens:,} prompt tokens) per policy, "
        f"{fleet}, KV store: {store}",
        file=sys.stderr,
    )
    try:
        with _store(_kvs_backend(args) == "mooncake") as master:
            spec = _fleet(args, master)
            if args.prfaas:
                demo = PrfaasDemo(args.prfaas_engines, args.prfaas_egress_gbps, args.prfaas_kv_bytes_per_token,
                                  args.prfaas_threshold_tokens, args.prfaas_bandwidth_mode)
                runs = run_async(lambda: run_prfaas_demo(spec, demo, requests, tokenizer,
                                                         progress=not args.no_progress))
            else:
                runs = run_async(lambda: run_demo(spec, requests, tokenizer, progress=not args.no_progress))
    except ServiceStartError as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    return _report(runs, args, started)


def _run_real(args: argparse.Namespace, requests: list[ReplayRequest], started: float) -> int:
    from kvgate.commands.engines import find_tiny_model
    from kvgate.demo.real_engines import engine_specs, run_real_demo
    from kvgate.engines.vllm import vllm_fleet
    from kvgate.gateway.planning.tokenizer import load_tokenizer

    found = find_tiny_model("demo")
    if found is None:
        return 1
    venv, model_dir = found
    capacity = args.cache_capacity_blocks or BUNDLED_CACHE_BLOCKS
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    print(f"kvgate demo: {len(requests)} requests ({prompt_tokens:,} prompt tokens) per policy, "
          f"{args.vllm_engines} real vLLM engines ({capacity} blocks of KV cache each), cache view: their KV "
          "events; starting the engines takes about a minute", file=sys.stderr)
    tokenizer = load_tokenizer(str(model_dir))
    try:
        with vllm_fleet(engine_specs(model_dir, args.vllm_engines, capacity), venv) as engines:
            runs = run_async(lambda: run_real_demo(engines, model_dir, requests, tokenizer,
                                                   progress=not args.no_progress))
    except (ServiceStartError, RuntimeError) as exc:
        print(f"demo: {exc}", file=sys.stderr)
        return 1
    return _report(runs, args, started)


def _report(runs, args: argparse.Namespace, started: float) -> int:
    print(format_table(runs))
    clock = ("TTFTs are the real engines' on this machine." if args.engines == "vllm"
             else f"TTFTs are real time at --time-scale {args.time_scale:g}.")
    print("\nThroughput is the offered load when both runs keep up with it (the replay is open loop); " + clock,
          file=sys.stderr)
    print(f"\n({time.perf_counter() - started:.0f} s in all)", file=sys.stderr)
    return 0 if all(run.summary.completed for run in runs) else 1
