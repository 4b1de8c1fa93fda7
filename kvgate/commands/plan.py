"""`kvgate plan`: size a deployment from profiles before building it.

`kvgate plan prfaas --config FILE` runs the Prefill-as-a-Service throughput model (a remote
prefill-only cluster joined to a local PD cluster by a link of limited bandwidth): grid search over
the offload threshold and the local prefill/decode split, printed beside the homogeneous-PD and
naive-heterogeneous baselines with the egress each implies. docs/PLANNER.md describes the file.
"""

from __future__ import annotations

import argparse
import sys

import orjson


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("plan", help="size a deployment from profiles", description=__doc__)
    plans = parser.add_subparsers(dest="plan", required=True, metavar="PLAN")
    prfaas = plans.add_parser(
        "prfaas",
        help="threshold and prefill/decode split for a remote prefill cluster",
        description="Prefill-as-a-Service planner: best threshold and local split, with baselines.",
    )
    prfaas.add_argument("--config", required=True, help="planner YAML (see docs/PLANNER.md)")
    prfaas.add_argument(
        "--trace",
        help="Mooncake-format trace replacing the config's workload (its input and mean output lengths)",
    )
    prfaas.add_argument("--json", action="store_true", help="print one JSON object")
    prfaas.set_defaults(func=run_prfaas)


def run_prfaas(args: argparse.Namespace) -> int:
    from kvgate.planner.config import PlanConfigError, load_plan
    from kvgate.planner.model import plan
    from kvgate.planner.report import plan_json, plan_table

    try:
        config, fleet, dist = load_plan(args.config, trace=args.trace)
        result = plan(fleet, dist)
    except (PlanConfigError, ValueError) as exc:
        print(f"kvgate plan prfaas: {exc}", file=sys.stderr)
        return 2
    if args.json:
        body = plan_json(result, fleet, dist, config.name)
        sys.stdout.write(orjson.dumps(body, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(plan_table(result, fleet, dist, config.name))
    return 0
