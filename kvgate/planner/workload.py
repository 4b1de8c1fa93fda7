"""Input-length distributions as weighted lengths: a truncated log-normal, or a trace's prompts.

Both become the same thing, sorted lengths with probabilities summing to one, so the throughput
model takes expectations (and expectations restricted to `l > t`) as weighted sums whatever the
source.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# Points of the log-normal's discretisation: each carries the probability of its bin in log space,
# so expectations of the (piecewise linear) profiles are exact to well under 0.1%.
LOGNORMAL_POINTS = 20_000


@dataclass(frozen=True)
class LengthDistribution:
    lengths: np.ndarray  # distinct, sorted ascending, tokens
    weights: np.ndarray  # probability of each length; sums to 1
    source: str  # what it was built from, for the report

    def mean(self) -> float:
        return float(self.weights @ self.lengths)

    def share_above(self, threshold: float) -> float:
        """P(l > threshold)."""
        return float(self.weights[self.lengths > threshold].sum())


def truncated_lognormal(mu: float, sigma: float, low: float, high: float) -> LengthDistribution:
    """ln(l) ~ N(mu, sigma^2) conditioned on low <= l <= high, discretised on a log-spaced grid."""
    if sigma <= 0 or not 1 <= low < high:
        raise ValueError("log-normal needs sigma > 0 and 1 <= min < max")
    edges = np.linspace(math.log(low), math.log(high), LOGNORMAL_POINTS + 1)
    cdf = np.array([_normal_cdf((e - mu) / sigma) for e in edges])
    mass = np.diff(cdf)
    if mass.sum() <= 0:
        raise ValueError(f"log-normal mu {mu} sigma {sigma} has no mass on [{low:g}, {high:g}]")
    # Each bin is 1/20000 of the log range wide (0.035% of length for [128, 128K]), so its
    # geometric centre stands for it without measurable error.
    centres = np.exp((edges[:-1] + edges[1:]) / 2)
    return LengthDistribution(
        centres, mass / mass.sum(), f"truncated log-normal mu {mu:g} sigma {sigma:g} on [{low:g}, {high:g}]"
    )


def trace_lengths(path: str | Path) -> tuple[LengthDistribution, float]:
    """The prompt lengths of a Mooncake-format trace (each request equally likely) and its mean
    output length."""
    from kvgate.simulator.trace import read_trace

    requests = read_trace(path)
    # Distinct lengths, weighted by how often they occur: a threshold then never splits equal prompts.
    lengths, counts = np.unique(np.array([r.input_length for r in requests], dtype=float), return_counts=True)
    weights = counts / len(requests)
    mean_output = sum(max(r.output_length, 1) for r in requests) / len(requests)
    return LengthDistribution(lengths, weights, f"trace {path} ({len(requests)} requests)"), mean_output


def _normal_cdf(z: float) -> float:
    return 0.5 * math.erfc(-z / math.sqrt(2))
