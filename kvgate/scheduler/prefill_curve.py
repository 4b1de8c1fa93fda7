"""A measured prefill curve: (prompt tokens, seconds of compute from scratch) points.

The one curve of the project: the TTFT model prices prefill and queues with it, and the engine
model (engine_model.profile.TablePrefillCost) steps simulated engines with it.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class PrefillCurve:
    """A chunk costs the curve's increase over the tokens it adds, so chunking a prompt costs what
    prefilling it at once does. Linear between points from (0, 0); the last slope continues."""

    points: tuple[tuple[int, float], ...]
    _xs: tuple[int, ...] = field(init=False, repr=False, compare=False)
    _ys: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        lengths = [n for n, _ in self.points]
        if not lengths or lengths != sorted(set(lengths)) or lengths[0] <= 0:
            raise ValueError("prefill table needs strictly increasing positive token counts")
        if any(s < 0 for _, s in self.points):
            raise ValueError("prefill table times must be >= 0")
        object.__setattr__(self, "_xs", (0, *lengths))
        object.__setattr__(self, "_ys", (0.0, *(s for _, s in self.points)))

    def cumulative_s(self, tokens: float) -> float:
        xs, ys = self._xs, self._ys
        i = min(max(bisect.bisect_right(xs, tokens), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (tokens - x0) / (x1 - x0)

    def chunk_s(self, cached_tokens: int, new_tokens: int) -> float:
        return self.cumulative_s(cached_tokens + new_tokens) - self.cumulative_s(cached_tokens)

    def per_token_s(self, prompt_tokens: float) -> float:
        """Average seconds per token of a whole prompt this long (prices a queue of such prompts)."""
        prompt_tokens = max(prompt_tokens, 1.0)
        return self.cumulative_s(prompt_tokens) / prompt_tokens
