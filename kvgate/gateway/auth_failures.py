"""A budget of failed authentications per client address, against guessing keys.

Every wrong API key (/v1/*) or admin token (/admin/*, admin-guarded debug routes) takes one token
from its address's bucket (`--auth-failure-budget` tokens, refilled at `--auth-failure-refill-per-s`).
Once the bucket is empty the address gets 429 with Retry-After for any authenticated route, before
its key is even looked at, until a token is back: a guesser is held to the refill rate, and learns
nothing while it waits. Keys are still compared in constant time (auth.py, admin.py).

Addresses are kept in least-recently-failed order up to `MAX_ADDRESSES`, so a scan from many
addresses cannot grow the table without bound (the oldest are forgotten first). Both front doors'
key checks read presented secrets through `header_bytes`.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import Counter

from kvgate.gateway.errors import APIError

MAX_ADDRESSES = 10_000


@dataclass(slots=True)
class _Address:
    tokens: float
    updated: float
    blocked_until: float = 0.0


class AuthFailureBudget:
    def __init__(self, budget: int, refill_per_s: float, throttled: Counter,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._budget = budget  # 0: no budget
        self._refill_per_s = refill_per_s
        self._throttled = throttled  # labelled by scope
        self._clock = clock
        self._addresses: OrderedDict[str, _Address] = OrderedDict()

    def check(self, address: str | None, scope: str) -> None:
        """429 if `address` spent its budget and no token is back yet."""
        entry = self._addresses.get(address or "")
        if entry is not None and entry.blocked_until > self._clock():
            self._refuse(entry, scope)

    def failed(self, address: str | None, scope: str) -> None:
        """One failed authentication from `address`; 429 if it was over the budget."""
        if not self._budget:
            return
        now = self._clock()
        key = address or ""
        entry = self._addresses.get(key)
        if entry is None:
            entry = self._addresses[key] = _Address(float(self._budget), now)
            if len(self._addresses) > MAX_ADDRESSES:
                self._addresses.popitem(last=False)
        else:
            self._addresses.move_to_end(key)
            entry.tokens = min(self._budget, entry.tokens + (now - entry.updated) * self._refill_per_s)
            entry.updated = now
        if entry.tokens >= 1:
            entry.tokens -= 1
            return
        entry.blocked_until = now + (1 - entry.tokens) / self._refill_per_s
        self._refuse(entry, scope)

    def _refuse(self, entry: _Address, scope: str) -> None:
        self._throttled.labels(scope).inc()
        wait_s = max(1, math.ceil(entry.blocked_until - self._clock()))
        raise APIError(429, "too many failed authentications from this address; retry later",
                       code="auth_failures_throttled", headers={"Retry-After": str(wait_s)})

    def __len__(self) -> int:
        return len(self._addresses)


def header_bytes(text: str) -> bytes:
    """A header value as the client sent it: aiohttp decodes bytes that are not UTF-8 to surrogates,
    which a plain encode() refuses (a 500 for what is only a wrong key)."""
    return text.encode("utf-8", "surrogateescape")
