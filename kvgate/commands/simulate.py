"""`kvgate simulate`: replay a Mooncake-format trace over simulated engines in virtual time.

Every request is routed by the gateway's own scheduler (same policies, same dispatch account, a
real embedded KV index the simulated engines publish to), so policies and their flags can be
compared on an hour of traffic in seconds. `--time-scale` multiplies the trace's timestamps:
0.5 replays it twice as fast. Scheduler flags are the `kvgate serve` flags, including the SLO ones
(`--ttft-slo-s`, `--tbt-slo-s`, `--early-rejection`). `--store-model shared` (default) puts the
instances' DRAM in one pool any of them loads from; `local` gives each its own cache.
`--kvs-backend kv_events` routes, as the gateway with that backend does, on each instance's own
HBM cache as its KV events report it, `--kv-events-lag-ms` late; any other backend (the default
mooncake) routes on the store model's index, and with `--kv-events-beside-store` on both (the store
for the pool, the events for each engine's own prefix, as instances with a `kv_events_endpoint`).

`--prefill-instances P --decode-instances D` replays over a disaggregated fleet; adding
`--prfaas-instances N` (with `--prfaas-egress-gbps` and the KV size, `--prfaas-kv-bytes-per-token`
or `--prfaas-kv-size-mib`) compares local-only PD, the naive PrfaaS rule and PrfaaS routing over a
remote prefill cluster behind that link (docs/PRFAAS.md). `--lognormal MU,SIGMA,MIN,MAX` replaces
the trace by a synthetic workload of that prompt-length distribution (`--lognormal-rps`,
`--output-tokens`, `--limit` requests).
"""

from __future__ import annotations

import argparse
import sys

import orjson
from tabulate import tabulate

from kvgate.config.loader import ConfigError, add_settings_arguments, load_settings
from kvgate.config.settings import KVSBackendName, Settings
from kvgate.scheduler.registry import POLICY_NAMES, check_settings
from kvgate.simulator.profile import DEFAULT_CACHE_BLOCKS, HBM_BLOCKS, STORE_MODELS
from kvgate.simulator.replicas import GatewayReplicas, spread_bursts

# Columns of the comparison table: (summary field, header, format).
_COLUMNS = (
    ("policy", "policy", "{}"),
    ("requests", "requests", "{}"),
    ("prefix_hit_ratio", "hit ratio", "{:.1%}"),
    ("mean_ttft_s", "mean TTFT s", "{:.3f}"),
    ("p50_ttft_s", "p50 TTFT s", "{:.3f}"),
    ("p90_ttft_s", "p90 TTFT s", "{:.3f}"),
    ("p99_ttft_s", "p99 TTFT s", "{:.3f}"),
    ("mean_queue_s", "mean queue s", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.2f}"),
    ("transfer_tokens", "transfer tok", "{}"),
    ("prediction_error_p50_s", "pred err p50 s", "{:.3f}"),
    ("prediction_error_p90_s", "pred err p90 s", "{:.3f}"),
    ("rejected", "rejected", "{}"),
    ("slo_attainment", "within SLO", "{:.1%}"),
    ("goodput_rps", "goodput/s", "{:.2f}"),
    ("prefill_busy_ratio", "prefill busy", "{:.0%}"),
    ("max_instance_requests", "max/inst", "{}"),
    ("min_instance_requests", "min/inst", "{}"),
    ("wall_time_s", "wall s", "{:.1f}"),
)


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser(
        "simulate", help="replay a trace over simulated engines", description=__doc__
    )
    parser.add_argument("--trace", help="Mooncake-format JSON lines file (or --lognormal)")
    parser.add_argument("--lognormal", help="instead of --trace: prompt lengths from a truncated log-normal "
                        "MU,SIGMA,MIN,MAX (of ln tokens; tokens), e.g. 9.90,1.00,128,131072; no shared prefixes")
    parser.add_argument("--lognormal-rps", type=float, default=1.0,
                        help="with --lognormal: Poisson arrival rate, requests/s (default 1.0)")
    parser.add_argument("--output-tokens", type=int, default=1024,
                        help="with --lognormal: output tokens of every request (default 1024)")
    parser.add_argument(
        "--instances",
        dest="num_instances",
        type=int,
        default=8,
        help="simulated engine instances (default 8)",
    )
    parser.add_argument(
        "--policy",
        dest="dispatch_policy",
        choices=POLICY_NAMES,
        default=argparse.SUPPRESS,
        help="same as --dispatch-policy",
    )
    parser.add_argument(
        "--policies", help="comma-separated policies to compare, e.g. round_robin,cache_aware"
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="multiply arrival times by this (default 1.0: the trace's own rate)",
    )
    parser.add_argument("--limit", type=int, help="replay only the first N requests")
    parser.add_argument(
        "--cache-capacity-blocks",
        type=int,
        default=DEFAULT_CACHE_BLOCKS,
        help=f"reusable KV cache of each instance in 512-token blocks (default {DEFAULT_CACHE_BLOCKS}: "
        f"HBM {HBM_BLOCKS} + host DRAM in the Mooncake store; with --store-model shared an eighth is HBM, "
        f"the rest the instance's DRAM segment; {HBM_BLOCKS} with local = HBM only)",
    )
    parser.add_argument(
        "--store-model",
        choices=STORE_MODELS,
        default="shared",
        help="shared (default): HBM per instance + a DRAM segment each in one pool any instance loads from"
        " (host link for its own, network for others'); local: one free cache per instance, no sharing",
    )
    parser.add_argument(
        "--kv-events-lag-ms",
        type=float,
        default=0.0,
        help="with --kvs-backend kv_events (the gateway routes on each instance's own HBM cache as its KV "
        "events report it, not on the store's index): from the end of the engine step that stored or evicted blocks to "
        "the gateway's index applying it (publisher queue, network, subscriber); default 0",
    )
    parser.add_argument(
        "--kv-events-beside-store",
        action="store_true",
        help="with a store backend: the engines also publish KV events (--kv-events-lag-ms late), as instances "
        "with a kv_events_endpoint do; an instance's local prefix is the longer of its segment's and its engine's",
    )
    parser.add_argument(
        "--oracle",
        action="store_true",
        help="add a greedy_oracle row: each request to the instance where a forward run of that engine's"
        " exact state gives the earliest first token (what perfect knowledge gains by placement alone)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the scheduler's random choices")
    parser.add_argument(
        "--gateway-replicas",
        type=int,
        default=1,
        help="N > 1: also replay through N gateway replicas taking the trace round-robin, blind to each "
        "other and then synced every --account-sync-interval-s (docs/SCALEOUT.md)",
    )
    parser.add_argument(
        "--spread-bursts",
        action="store_true",
        help="space requests recorded at one timestamp evenly until the next (the conversation trace "
        "records 3 s bursts; see simulator/replicas.py)",
    )
    # --- prefill/decode disaggregation (docs/PD.md) ---
    parser.add_argument("--prefill-instances", type=int, help="with --decode-instances: replay over a "
                        "disaggregated fleet, compared with as many neutral instances (TTFT and time between tokens)")
    parser.add_argument("--decode-instances", type=int, help="decode instances of the disaggregated fleet")
    parser.add_argument("--kv-transfer-tokens-per-s", type=float, default=None,
                        help="prompt tokens per second moved from a prefill to a decode instance (default 100000)")
    parser.add_argument("--prfaas-instances", type=int, help="with --prefill-instances and --decode-instances: "
                        "prefill instances of a remote PrfaaS cluster behind --prfaas-egress-gbps; compares "
                        "local-only PD, the naive rule (every long prompt remote) and PrfaaS routing")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", help="write TTFT CDFs per policy to this image file")
    add_settings_arguments(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    # Deferred: `kvgate --help` should not pay for the simulator's imports.
    from kvgate.simulator.profile import trace_profile
    from kvgate.simulator.replay import hit_ratio_reference, simulate
    from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceError, read_trace

    cli_values = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    cli_values.setdefault("kvs_chunk_size", TRACE_BLOCK_TOKENS)
    if args.prfaas_instances is not None and not args.config:
        cli_values.setdefault("prfaas_cluster", "prfaas")
    try:
        policies = _policies(args)
        if args.num_instances < 1 or args.gateway_replicas < 1 or (args.limit is not None and args.limit < 1):
            raise ValueError("--instances, --gateway-replicas and --limit must be >= 1")
        if args.kv_events_lag_ms < 0:
            raise ValueError("--kv-events-lag-ms must be >= 0")
        fleets = (args.prfaas_instances, args.prefill_instances, args.decode_instances)
        disaggregated = any(count is not None for count in fleets)
        profile = trace_profile(args.cache_capacity_blocks)
        base = load_settings(cli_values, config_path=args.config)
        check_settings(base)
        events_alone = base.kvs_backend == KVSBackendName.KV_EVENTS
        if (events_alone or args.kv_events_beside_store) and disaggregated:
            raise ValueError("KV events (--kvs-backend kv_events, --kv-events-beside-store) replay neutral "
                             "instances only (not PD or PrfaaS yet)")
        if events_alone and args.kv_events_beside_store:
            raise ValueError("--kv-events-beside-store needs a store backend (--kvs-backend kv_events asks none)")
        requests = _workload(args, read_trace)
        if args.spread_bursts:
            requests = spread_bursts(requests)
    except (ConfigError, TraceError, ValueError) as exc:
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    if args.prfaas_instances is not None:
        from kvgate.commands.simulate_prfaas import run_prfaas

        return run_prfaas(args, base, requests, profile)

    if args.prefill_instances is not None or args.decode_instances is not None:
        return _run_pd(args, base, requests, profile)
    reference = hit_ratio_reference(requests, args.num_instances * profile.cache_capacity_blocks)
    show_progress = not args.json and sys.stderr.isatty()
    results = {}
    for policy in policies or [base.effective_policy]:
        settings = base.model_copy(update={"dispatch_policy": policy}) if policies else base
        for label, replicas in _gateways(policy, settings, args.gateway_replicas):
            try:
                results[label] = simulate(
                    requests,
                    settings,
                    args.num_instances,
                    profile,
                    seed=args.seed,
                    show_progress=show_progress,
                    reference=reference,
                    store_model=args.store_model,
                    replicas=replicas,
                    kv_events_lag_s=args.kv_events_lag_ms / 1000,
                    engine_events=args.kv_events_beside_store,
                )
            except ValueError as exc:
                print(f"kvgate simulate: {exc}", file=sys.stderr)
                return 2
    if args.oracle:
        from kvgate.simulator.oracle import ORACLE_NAME, OracleReplay

        results[ORACLE_NAME] = OracleReplay(requests, base, args.num_instances, profile, seed=args.seed,
                                            show_progress=show_progress, reference=reference,
                                            store_model=args.store_model).run()

    header = {
        "trace": args.trace,
        "instances": args.num_instances,
        "time_scale": args.time_scale,
        "store_model": args.store_model,
        "kvs_backend": str(base.kvs_backend),
        "cache_view": _cache_view(base, args.kv_events_beside_store),
        **({"kv_events_lag_ms": args.kv_events_lag_ms}
           if base.kvs_backend == KVSBackendName.KV_EVENTS or args.kv_events_beside_store else {}),
        "cache_capacity_blocks": profile.cache_capacity_blocks,
        "ideal_hit_ratio": reference.ideal,
        "fleet_lru_hit_ratio": reference.fleet_lru,
    }
    if args.plot:
        title = (
            f"{len(requests)} requests, {args.num_instances} instances, time scale {args.time_scale:g}, "
            f"{profile.cache_capacity_blocks} blocks/instance"
        )
        from kvgate.simulator.plot import plot_ttft_cdfs

        plot_ttft_cdfs({name: r.ttfts for name, r in results.items()}, args.plot, title)
    if args.json:
        summaries = {name: r.summary.to_dict() for name, r in results.items()}
        several = policies or args.gateway_replicas > 1 or args.oracle
        body = {**header, "policies": summaries} if several else {**header, **summaries.popitem()[1]}
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    print(_report(header, [{**r.summary.to_dict(), "policy": name} for name, r in results.items()]))
    if args.plot:
        print(f"TTFT CDF written to {args.plot}")
    return 0


def _gateways(policy: str, settings: Settings, replicas: int) -> list[tuple[str, GatewayReplicas | None]]:
    """(label, replicas): one gateway; with N > 1 replicas also N blind ones and N synced ones."""
    if replicas == 1:
        return [(policy, None)]
    staleness = settings.request_local_account_staleness_s
    interval = settings.account_sync_interval_s
    return [
        (f"{policy}, 1 gateway", None),
        (f"{policy}, {replicas} replicas blind", GatewayReplicas(replicas, staleness, None)),
        (f"{policy}, {replicas} replicas synced {interval:g} s", GatewayReplicas(replicas, staleness, interval)),
    ]


# Columns of the PD comparison: (row field, header, format).
_PD_COLUMNS = (
    ("fleet", "fleet", "{}"),
    ("requests", "requests", "{}"),
    ("prefix_hit_ratio", "hit ratio", "{:.1%}"),
    ("p50_ttft_s", "p50 TTFT s", "{:.3f}"),
    ("p90_ttft_s", "p90 TTFT s", "{:.3f}"),
    ("p99_ttft_s", "p99 TTFT s", "{:.3f}"),
    ("p50_tbt_ms", "p50 TBT ms", "{:.1f}"),
    ("p90_tbt_ms", "p90 TBT ms", "{:.1f}"),
    ("p99_tbt_ms", "p99 TBT ms", "{:.1f}"),
    ("wall_time_s", "wall s", "{:.1f}"),
)


def _run_pd(args: argparse.Namespace, settings: Settings, requests, profile) -> int:
    """P prefill + D decode instances against P + D neutral ones, same policy, same trace."""
    from kvgate.simulator.pd_replay import DEFAULT_KV_TRANSFER_TOKENS_PER_S, simulate_pd
    from kvgate.simulator.replay import simulate
    from kvgate.simulator.report import percentile

    prefill, decode = args.prefill_instances, args.decode_instances
    rate = args.kv_transfer_tokens_per_s or DEFAULT_KV_TRANSFER_TOKENS_PER_S
    if prefill is None or decode is None or prefill < 1 or decode < 1 or rate <= 0:
        print("kvgate simulate: --prefill-instances and --decode-instances go together, each >= 1; "
              "--kv-transfer-tokens-per-s > 0", file=sys.stderr)
        return 2
    show_progress = not args.json and sys.stderr.isatty()
    try:
        runs = {
            f"neutral x{prefill + decode}": simulate(requests, settings, prefill + decode, profile, seed=args.seed,
                                                      show_progress=show_progress, store_model=args.store_model),
            f"pd {prefill}P+{decode}D": simulate_pd(requests, settings, prefill, decode, profile, seed=args.seed,
                                                    kv_transfer_tokens_per_s=rate, show_progress=show_progress,
                                                    store_model=args.store_model),
        }
    except ValueError as exc:
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    rows = []
    for fleet, result in runs.items():
        tbts = sorted(result.tbts)
        summary = result.summary.to_dict()
        rows.append({"fleet": fleet, **{k: summary[k] for k in (
            "requests", "prefix_hit_ratio", "p50_ttft_s", "p90_ttft_s", "p99_ttft_s", "wall_time_s")},
            **{f"p{q}_tbt_ms": percentile(tbts, q) * 1000 if tbts else None for q in (50, 90, 99)}})
    if args.json:
        body = {"trace": args.trace, "policy": settings.effective_policy, "time_scale": args.time_scale,
                "store_model": args.store_model,
                "kv_transfer_tokens_per_s": rate, "fleets": rows}
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    table = tabulate([[_cell(fmt, row[field]) for field, _, fmt in _PD_COLUMNS] for row in rows],
                     headers=[h for _, h, _ in _PD_COLUMNS], disable_numparse=True)
    print(f"trace {args.trace}: {len(requests)} requests, policy {settings.effective_policy}, "
          f"{args.store_model} store, time scale {args.time_scale:g}, KV transfer {rate:,.0f} tokens/s, KV cache {profile.cache_capacity_blocks} "
          f"blocks/instance\n\n{table}")
    return 0


def _workload(args: argparse.Namespace, read_trace) -> list:
    if bool(args.trace) == bool(args.lognormal):
        raise ValueError("give one workload: --trace FILE or --lognormal MU,SIGMA,MIN,MAX")
    if args.trace:
        return read_trace(args.trace, limit=args.limit, time_scale=args.time_scale)
    from kvgate.simulator.synthetic import lognormal_requests, parse_lognormal

    mu, sigma, low, high = parse_lognormal(args.lognormal)
    args.trace = f"log-normal mu {mu:g} sigma {sigma:g} on [{low:g}, {high:g}] at {args.lognormal_rps:g} req/s"
    return lognormal_requests(args.limit or 1000, args.lognormal_rps / args.time_scale, mu, sigma, low, high,
                              args.output_tokens, seed=args.seed)


def _policies(args: argparse.Namespace) -> list[str]:
    if not args.policies:
        return []
    names = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in names if p not in POLICY_NAMES]
    if unknown or not names:
        raise ValueError(f"--policies: unknown {unknown or 'empty list'}; choose from {', '.join(POLICY_NAMES)}")
    return list(dict.fromkeys(names))


def _cell(fmt: str, value) -> str:
    return "n/a" if value is None else fmt.format(value)


def _report(header: dict, summaries: list[dict]) -> str:
    rows = [[_cell(fmt, s[field]) for field, _, fmt in _COLUMNS] for s in summaries]
    table = tabulate(rows, headers=[h for _, h, _ in _COLUMNS], disable_numparse=True)
    return "\n".join(
        [
            f"trace {header['trace']}: {summaries[0]['requests']} requests, {header['instances']} instances,"
            f" time scale {header['time_scale']:g}, KV cache {header['cache_capacity_blocks']} blocks/instance,"
            f" {header['store_model']} store" + _view_note(header),
            f"hit ratio bounds: ideal (one infinite cache) {header['ideal_hit_ratio']:.1%},"
            f" one LRU as large as the fleet {header['fleet_lru_hit_ratio']:.1%}",
            "",
            table,
        ]
    )


def _cache_view(settings: Settings, beside_store: bool) -> str:
    """What the simulated gateway routes on: store, kv_events or store+kv_events."""
    if settings.kvs_backend == KVSBackendName.KV_EVENTS:
        return "kv_events"
    return "store+kv_events" if beside_store else "store"


def _view_note(header: dict) -> str:
    lag_ms = header.get("kv_events_lag_ms")
    if lag_ms is None:
        return ""
    beside = " beside the store" if header["cache_view"] == "store+kv_events" else ""
    return f", routed on KV events {lag_ms:g} ms late{beside}"
