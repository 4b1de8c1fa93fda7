"""`kvgate simulate ... --prfaas-instances N`: local-only PD vs the naive rule vs PrfaaS routing.

Three replays of one workload: the local cluster alone (P prefill + D decode), then the same
cluster with N remote prefill instances behind the link, routed by the naive rule (every prompt
longer than the threshold crosses, at a fixed threshold) and by the PrfaaS rule (incremental
length, bandwidth mode, adaptive threshold). Throughput within SLO counts the requests that met
--ttft-slo-s and --tbt-slo-s (0: no constraint) per second of makespan.
"""

from __future__ import annotations

import argparse
import sys

import orjson
from tabulate import tabulate

from kvgate.config.settings import Settings

# (row field, header, format)
_COLUMNS = (
    ("fleet", "fleet", "{}"),
    ("requests", "requests", "{}"),
    ("offload_fraction", "offloaded", "{:.1%}"),
    ("p50_ttft_s", "p50 TTFT s", "{:.3f}"),
    ("p90_ttft_s", "p90 TTFT s", "{:.3f}"),
    ("slo_attainment", "within SLO", "{:.1%}"),
    ("goodput_rps", "within SLO req/s", "{:.3f}"),
    ("throughput_rps", "req/s", "{:.3f}"),
    ("link_utilisation", "link busy", "{:.1%}"),
    ("egress_gbps", "egress Gbps", "{:.2f}"),
    ("final_threshold_tokens", "threshold", "{}"),
    ("wall_time_s", "wall s", "{:.1f}"),
)


def run_prfaas(args: argparse.Namespace, settings: Settings, requests, profile) -> int:
    from kvgate.simulator.pd_replay import DEFAULT_KV_TRANSFER_TOKENS_PER_S, simulate_pd
    from kvgate.simulator.prfaas_replay import PrfaasReplay

    prefill, decode, remote = args.prefill_instances, args.decode_instances, args.prfaas_instances
    rate = args.kv_transfer_tokens_per_s or DEFAULT_KV_TRANSFER_TOKENS_PER_S
    if prefill is None or decode is None or prefill < 1 or decode < 1 or remote < 1 or rate <= 0:
        print("kvgate simulate: --prfaas-instances needs --prefill-instances and --decode-instances, each >= 1",
              file=sys.stderr)
        return 2
    if not settings.prfaas_cluster:
        print("kvgate simulate: --prfaas-instances needs --prfaas-cluster (set in --config)", file=sys.stderr)
        return 2
    show_progress = not args.json and sys.stderr.isatty()
    common = {"kv_transfer_tokens_per_s": rate, "seed": args.seed, "show_progress": show_progress,
              "store_model": args.store_model}
    rows = []
    try:
        local = simulate_pd(requests, settings.model_copy(update={"prfaas_cluster": ""}), prefill, decode, profile,
                            **common)
        rows.append(_row(f"local PD {prefill}P+{decode}D", local.summary.to_dict(), None))
        for name, naive in (("naive", True), ("prfaas", False)):
            replay = PrfaasReplay(requests, settings, prefill, decode, remote, profile, naive=naive, **common)
            outcome = replay.run_prfaas()
            rows.append(_row(f"{name} {prefill}P+{decode}D+{remote}R", outcome.result.summary.to_dict(), outcome.link))
    except ValueError as exc:
        print(f"kvgate simulate: {exc}", file=sys.stderr)
        return 2
    header = {"workload": args.trace, "policy": settings.effective_policy, "store_model": args.store_model,
              "prfaas_egress_gbps": settings.prfaas_egress_gbps, "prfaas_threshold_tokens": settings.prfaas_threshold_tokens,
              "prfaas_bandwidth_mode": settings.prfaas_bandwidth_mode.value, "ttft_slo_s": settings.ttft_slo_s,
              "tbt_slo_s": settings.tbt_slo_s}
    if args.json:
        sys.stdout.write(orjson.dumps({**header, "fleets": rows}, option=orjson.OPT_INDENT_2).decode() + "\n")
        return 0
    table = tabulate([["n/a" if row[f] is None else fmt.format(row[f]) for f, _, fmt in _COLUMNS] for row in rows],
                     headers=[h for _, h, _ in _COLUMNS], disable_numparse=True)
    print(f"{header['workload']}: {len(requests)} requests, policy {header['policy']}, {args.store_model} store, "
          f"link {settings.prfaas_egress_gbps:g} Gbps, threshold {settings.prfaas_threshold_tokens} "
          f"({header['prfaas_bandwidth_mode']}), SLO TTFT {settings.ttft_slo_s:g} s TBT {settings.tbt_slo_s:g} s\n\n"
          f"{table}")
    return 0


def _row(fleet: str, summary: dict, link) -> dict:
    makespan = summary["makespan_s"]
    return {
        "fleet": fleet,
        **{k: summary[k] for k in ("requests", "p50_ttft_s", "p90_ttft_s", "slo_attainment", "goodput_rps",
                                   "throughput_rps", "wall_time_s")},
        "offload_fraction": link.offloaded / link.decided if link and link.decided else (None if link else 0.0),
        "link_utilisation": link.utilisation(makespan) if link else None,
        "egress_gbps": link.egress_gbps(makespan) if link else None,
        "final_threshold_tokens": link.final_threshold_tokens if link else None,
    }
