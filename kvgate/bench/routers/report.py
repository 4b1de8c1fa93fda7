"""The figures of a `kvgate bench routers` run: the table, the JSON file and the plot."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from kvgate.bench.routers.targets import DIRECT, KVGATE, RoutersConfig, TargetResult


def _direct(results: Sequence[TargetResult]) -> TargetResult | None:
    return next((r for r in results if r.target.router == DIRECT and r.status == "ok"), None)


def added_latency_ms(result: TargetResult, baseline: TargetResult | None, concurrency: int,
                     quantile: str) -> float | None:
    mine = result.overhead.get(concurrency)
    base = baseline.overhead.get(concurrency) if baseline else None
    if not mine or not base or not mine.latency or not base.latency:
        return None
    return (getattr(mine.latency, quantile) - getattr(base.latency, quantile)) * 1000


def _fmt(value: float | None, pattern: str = "{:.2f}") -> str:
    return "-" if value is None else pattern.format(value)


def table_rows(results: Sequence[TargetResult], concurrency: Sequence[int]) -> tuple[list[str], list[list[str]]]:
    baseline = _direct(results)
    top = max(concurrency)
    # hit ratio: cached_tokens in the answers; engines' hits: their own counters; ideal: the slice's bound.
    headers = ["target", "hit ratio", "engines' hits", "ideal", "TTFT P50 ms", "TTFT P90 ms", "TTFT mean ms",
               "load skew", "errors"]
    for c in concurrency:
        headers += [f"+p50 c{c} ms", f"+p99 c{c} ms"]
    headers += [f"req/s c{top}", "note"]
    rows = []
    for r in results:
        replay = r.replay
        errors = sum(replay.errors.values()) if replay else None
        row = [
            r.target.label,
            _fmt(replay.hit_ratio if replay else None, "{:.1%}"),
            _fmt(r.engine_hit_ratio, "{:.1%}"),
            _fmt(r.ideal_hit_ratio, "{:.1%}"),
            _fmt(replay.ttft.p50 * 1000 if replay and replay.ttft else None, "{:.0f}"),
            _fmt(replay.ttft.p90 * 1000 if replay and replay.ttft else None, "{:.0f}"),
            _fmt(replay.ttft.mean * 1000 if replay and replay.ttft else None, "{:.0f}"),
            _fmt(r.load_skew),
            "-" if errors is None else str(errors),
        ]
        for c in concurrency:
            if r is baseline:
                row += [_fmt(r.overhead[c].latency.p50 * 1000 if c in r.overhead else None, "({:.2f})"),
                        _fmt(r.overhead[c].latency.p99 * 1000 if c in r.overhead else None, "({:.2f})")]
            else:
                row += [_fmt(added_latency_ms(r, baseline, c, "p50")), _fmt(added_latency_ms(r, baseline, c, "p99"))]
        loop = r.overhead.get(top)
        row.append(_fmt(loop.requests_per_s if loop else None, "{:,.0f}"))
        notes = [r.reason] if r.status != "ok" else (["absolute latency (baseline)"] if r is baseline else [])
        if r.view_agreement is not None:
            c = r.hit_comparisons
            notes.append(f"view agreed with the engine on {r.view_agreement:.0%} (engine higher "
                         f"{c.get('engine_higher', 0)}, view higher {c.get('gateway_higher', 0)})")
        if "tokenize" in r.gateway_stage_ms:
            notes.append(f"tokenize stage {r.gateway_stage_ms['tokenize']:.0f} ms/req")
        notes += r.notes
        if replay and replay.errors:
            notes.append(", ".join(f"{k} {v}" for k, v in replay.errors.items()))
        row.append("; ".join(notes))
        rows.append(row)
    return headers, rows


def results_json(config: RoutersConfig, results: Sequence[TargetResult]) -> dict:
    baseline = _direct(results)
    out = []
    for r in results:
        overhead = {}
        for c, loop in r.overhead.items():
            overhead[str(c)] = {
                "requests": loop.requests, "errors": loop.errors, "requests_per_s": loop.requests_per_s,
                "latency": asdict(loop.latency) if loop.latency else None,
                "added_p50_ms": added_latency_ms(r, baseline, c, "p50"),
                "added_p99_ms": added_latency_ms(r, baseline, c, "p99"),
            }
        out.append({"target": r.target.label, "status": r.status, "reason": r.reason,
                    "replay": r.replay.to_dict() if r.replay else None,
                    "engine_prompt_tokens": list(r.engine_prompt_tokens), "load_skew": r.load_skew,
                    "engine_hit_ratio": r.engine_hit_ratio, "ideal_hit_ratio": r.ideal_hit_ratio,
                    "gateway_stage_ms": r.gateway_stage_ms, "hit_comparisons": r.hit_comparisons,
                    "notes": r.notes, "load_average": r.load_average,
                    "overhead": overhead})
    settings = {k: v for k, v in asdict(config).items() if k not in ("targets", "venv_dir", "log_dir")}
    return {"config": settings, "results": out}


def plot(results: Sequence[TargetResult], concurrency: Sequence[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    baseline = _direct(results)
    # One colour per router, one line style per policy.
    colours = {KVGATE: "tab:blue", "sglang-router": "tab:green", "vllm-router": "tab:purple", DIRECT: "grey"}
    styles = {"cache_aware": "-", "round_robin": "--", "prefix": "-.", "least_load": ":"}
    widths = {"store": 1.6, "events": 2.2, "both": 2.8}  # kvgate's cache views, thinnest to thickest
    fig, (cdf, bars, rates) = plt.subplots(1, 3, figsize=(17, 5.2))
    for r in results:
        if r.ttfts_s:
            xs = sorted(t * 1000 for t in r.ttfts_s)
            cdf.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=r.target.label,
                     color=colours.get(r.target.router), linestyle=styles.get(r.target.policy, "-"),
                     linewidth=widths[r.target.view] if r.target.router == KVGATE else 1.4)
    cdf.set_xscale("log")
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("Trace replay: TTFT CDF")
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=8)

    routed = [r for r in results if r is not baseline and r.overhead]
    width = 0.8 / max(1, 2 * len(concurrency))
    for j, c in enumerate(concurrency):
        for k, quantile in enumerate(("p50", "p99")):
            values = [added_latency_ms(r, baseline, c, quantile) or 0.0 for r in routed]
            offset = (2 * j + k) * width
            bars.bar([i + offset for i in range(len(routed))], values, width, label=f"{quantile} at c={c}")
    bars.set_xticks([i + width * (len(concurrency) - 0.5) for i in range(len(routed))])
    bars.set_xticklabels([r.target.label for r in routed], rotation=30, ha="right", fontsize=8)
    bars.set_ylabel("added latency vs direct (ms)")
    bars.set_title("Overhead: latency added by the router")
    bars.legend(fontsize=8)
    bars.grid(True, axis="y", alpha=0.3)

    top = max(concurrency)
    with_rate = [r for r in results if top in r.overhead]
    rates.bar(range(len(with_rate)), [r.overhead[top].requests_per_s for r in with_rate],
              color=[colours.get(r.target.router) for r in with_rate])
    rates.set_xticks(range(len(with_rate)))
    rates.set_xticklabels([r.target.label for r in with_rate], rotation=30, ha="right", fontsize=8)
    rates.set_ylabel(f"requests/s at concurrency {top}")
    rates.set_title("Overhead: request rate (2 KB prompt, 1 token)")
    rates.grid(True, axis="y", alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
