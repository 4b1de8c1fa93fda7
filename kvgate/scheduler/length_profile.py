"""A quantity measured at a few prompt lengths (prefill latency, KV size), read at any length.

Profiles are published at a handful of lengths (1K, 8K, 32K, 128K); between two of them the value
is interpolated linearly, and outside the measured range the nearest segment is extended, floored at
zero. Linear pieces suit both quantities: prefill time is close to linear per segment once attention
is a minority of the FLOPs, and a hybrid-attention model's KV size is a fixed recurrent state plus a
per-token part, a line with an intercept.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LengthProfile:
    lengths: np.ndarray  # strictly increasing prompt lengths in tokens
    values: np.ndarray  # the quantity at each of them

    @classmethod
    def from_points(cls, points: Mapping[int, float]) -> LengthProfile:
        """Profile from {length: value}; needs two points or more, lengths >= 1, values >= 0."""
        if len(points) < 2:
            raise ValueError("a profile needs at least two lengths")
        lengths = np.array(sorted(points), dtype=float)
        values = np.array([points[k] for k in sorted(points)], dtype=float)
        if lengths[0] < 1 or (values < 0).any():
            raise ValueError("profile lengths must be >= 1 and values >= 0")
        return cls(lengths, values)

    def value(self, length: float) -> float:
        """The quantity at one length."""
        return float(self.at(np.array([length]))[0])

    def at(self, lengths: np.ndarray) -> np.ndarray:
        """The quantity at each length: piecewise linear, end segments extended, never below zero."""
        x = np.asarray(lengths, dtype=float)
        xs, ys = self.lengths, self.values
        inside = np.interp(x, xs, ys)
        left = ys[0] + (x - xs[0]) * (ys[1] - ys[0]) / (xs[1] - xs[0])
        right = ys[-1] + (x - xs[-1]) * (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
        out = np.where(x < xs[0], left, np.where(x > xs[-1], right, inside))
        return np.maximum(out, 0.0)
