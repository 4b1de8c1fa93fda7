"""The demo's side-by-side table: one column per policy, one row per figure."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from tabulate import tabulate

from kvgate.bench.loadgen import ReplaySummary
from kvgate.demo.runner import PolicyRun


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _errors(summary: ReplaySummary) -> str:
    if not summary.errors:
        return "0"
    return (
        f"{sum(summary.errors.values())} (" + ", ".join(f"{k} {v}" for k, v in summary.errors.items()) + ")"
    )


ROWS: tuple[tuple[str, Callable[[ReplaySummary], str]], ...] = (
    ("requests", lambda s: f"{s.completed} / {s.requests}"),
    ("errors", _errors),
    (
        "prefix hit ratio (cached / prompt tokens)",
        lambda s: "-" if s.hit_ratio is None else f"{s.hit_ratio:.1%}",
    ),
    ("prompt tokens computed (not cached)", lambda s: f"{s.prompt_tokens - s.cached_tokens:,}"),
    ("TTFT mean", lambda s: _ms(s.ttft.mean if s.ttft else None)),
    ("TTFT P90", lambda s: _ms(s.ttft.p90 if s.ttft else None)),
    ("throughput (req/s)", lambda s: f"{s.requests_per_s:.2f}"),
    ("throughput (output tok/s)", lambda s: f"{s.output_tokens_per_s:,.0f}"),
)


def format_table(runs: Sequence[PolicyRun], tablefmt: str = "github") -> str:
    headers = ("", *(run.policy for run in runs))
    rows = [(label, *(render(run.summary) for run in runs)) for label, render in ROWS]
    # Figures some runs read from their gateway (the PrfaaS link's), "-" where a run has none.
    extra = dict.fromkeys(label for run in runs for label in run.gateway)
    rows += [(label, *(run.gateway.get(label, "-") for run in runs)) for label in extra]
    return tabulate(rows, headers=headers, tablefmt=tablefmt, colalign=("left", *("right" for _ in runs)))
