"""TTFT distribution plots of simulated policies (matplotlib, headless)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_ttft_cdfs(ttfts_by_policy: Mapping[str, Sequence[float]], path: str | Path, title: str) -> None:
    """One empirical CDF per policy on a log time axis, written to `path` (format from its suffix)."""
    import matplotlib

    matplotlib.use("Agg")  # no display on servers and in CI
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for policy, ttfts in ttfts_by_policy.items():
        values = sorted(t for t in ttfts if t > 0)
        if not values:
            continue
        fractions = [(i + 1) / len(values) for i in range(len(values))]
        ax.step(values, fractions, where="post", label=policy)
    ax.set_xscale("log")
    ax.set_xlabel("time to first token (s, log scale)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.0)
    ax.axhline(0.9, color="grey", linewidth=0.6, linestyle=":")
    ax.grid(True, which="both", linewidth=0.3)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="lower right")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
