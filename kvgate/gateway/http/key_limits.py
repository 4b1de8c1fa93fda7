"""One API key's rate and in-flight limits as the gateway counts them (auth.py decides with them).

A single-process gateway keeps them in memory (`LocalKeyLimit`). A worker of `kvgate serve
--workers N` gets them from its `WorkerShare` (kvgate/workers/shared_key_limits.py), in memory every
worker shares, so the limits hold for the whole gateway, not once per worker.
"""

from __future__ import annotations

from typing import Protocol


class TokenBucket:
    """`rate` tokens per second up to `burst`; a request takes one. `tokens` and `updated` are its
    whole state (a shared bucket loads and stores them around `take`)."""

    __slots__ = ("_rate", "_burst", "tokens", "updated")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = burst
        self.tokens = float(burst)
        self.updated = now

    def take(self, now: float) -> float:
        """0 if a token was taken; otherwise the seconds until one will be available."""
        self.tokens = min(self._burst, self.tokens + (now - self.updated) * self._rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self._rate


class KeyLimit(Protocol):
    """A key's token bucket and in-flight count."""

    def take(self, now: float) -> float:
        """0 if the key may start a request now (a token taken); otherwise the seconds to wait."""

    def enter(self) -> int:
        """Count one more request in flight; returns the key's count with it."""

    def leave(self) -> None:
        """Count one request fewer (the one `enter` counted)."""


class LocalKeyLimit:
    """The key's limits in this process alone. `bucket` None: no rate limit."""

    __slots__ = ("_bucket", "_inflight")

    def __init__(self, bucket: TokenBucket | None) -> None:
        self._bucket = bucket
        self._inflight = 0

    def take(self, now: float) -> float:
        return 0.0 if self._bucket is None else self._bucket.take(now)

    def enter(self) -> int:
        self._inflight += 1
        return self._inflight

    def leave(self) -> None:
        self._inflight -= 1
