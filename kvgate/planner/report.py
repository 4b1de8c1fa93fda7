"""How a plan is shown: a table for people, a JSON object for scripts."""

from __future__ import annotations

from tabulate import tabulate

from kvgate.planner.model import Fleet, OperatingPoint, Plan
from kvgate.planner.workload import LengthDistribution

_ROWS = (
    ("PrfaaS (best)", "best"),
    ("homogeneous PD", "homogeneous_pd"),
    ("naive heterogeneous", "naive_heterogeneous"),
)


def plan_json(plan: Plan, fleet: Fleet, dist: LengthDistribution, name: str) -> dict:
    """The best point's fields at the top level, the baselines under `baselines`."""
    return {
        "name": name,
        "workload": dist.source,
        "mean_input_tokens": dist.mean(),
        "output_tokens": fleet.output_tokens,
        "egress_link_gbps": fleet.egress_gbps,
        **plan.best.to_dict(),
        "baselines": {
            "homogeneous_pd": plan.homogeneous_pd.to_dict(),
            "naive_heterogeneous": plan.naive_heterogeneous.to_dict(),
        },
    }


def plan_table(plan: Plan, fleet: Fleet, dist: LengthDistribution, name: str) -> str:
    base = plan.homogeneous_pd.lambda_max_rps
    rows = [_row(label, getattr(plan, attr), fleet, base) for label, attr in _ROWS]
    headers = [
        "configuration",
        "threshold",
        "PrfaaS inst",
        "local P/D",
        "offloaded",
        "Θ_prfaas",
        "Θ_pd-p",
        "Θ_pd-d",
        "Λ_max req/s",
        "vs homogeneous",
        "egress Gbps",
        "bound by",
    ]
    title = f"{name}: " if name else ""
    return "\n".join(
        [
            f"{title}{dist.source}, mean input {dist.mean():,.0f} tokens, output {fleet.output_tokens:,.0f} tokens",
            f"PrfaaS cluster {fleet.prfaas_instances} instances, local PD cluster {fleet.local_instances} instances,"
            f" egress link {fleet.egress_gbps:g} Gbps",
            "",
            tabulate(rows, headers=headers, disable_numparse=True),
        ]
    )


def _row(label: str, point: OperatingPoint, fleet: Fleet, base_rps: float) -> list[str]:
    if point.threshold_tokens is None:
        threshold = "none offloaded"
    elif point.offload_fraction >= 1:
        threshold = "all offloaded"
    else:
        threshold = f"> {point.threshold_tokens:,}"
    gain = f"{point.lambda_max_rps / base_rps:.2f}x" if base_rps > 0 else "n/a"
    share = point.egress_gbps / fleet.egress_gbps
    return [
        label,
        threshold,
        str(point.n_prfaas),
        f"{point.n_prefill}P {point.n_decode}D",
        f"{point.offload_fraction:.1%}",
        _rps(point.theta_prfaas_rps),
        _rps(point.theta_pd_p_rps),
        _rps(point.theta_pd_d_rps),
        f"{point.lambda_max_rps:.2f}",
        gain,
        f"{point.egress_gbps:.1f} ({share:.0%})",
        point.bottleneck,
    ]


def _rps(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"
