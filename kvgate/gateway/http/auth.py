"""Client access control on /v1/*: API keys, a per-key rate limit and a per-key in-flight cap.

Off unless --api-keys-file is set. Then every /v1/* request needs `Authorization: Bearer <key>`
(401 otherwise); each key may start `--api-key-rate-limit-rps` requests per second with a burst of
`--api-key-rate-limit-burst`, and hold `--api-key-max-inflight` requests at once (429 with
Retry-After beyond either). Only the key's name reaches logs and metrics.

Keys are looked up by their SHA-256 digest and the match confirmed with a constant-time compare:
the time taken says nothing about how much of a guessed key was right. A wrong key also spends
its client address's failure budget (auth_failures.py): past it, 429 instead of 401.

The gateway's keys never leave the gateway: with --api-keys-file the client's Authorization header
is not passed to engines (they get --engine-api-key, or nothing). Without it the header is passed
through unchanged, as before, for engines that check their own keys.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from aiohttp import web

from kvgate.config.api_keys import ApiKey
from kvgate.config.settings import Settings
from kvgate.gateway.auth_failures import AuthFailureBudget, header_bytes
from kvgate.gateway.errors import APIError, Handler
from kvgate.gateway.http.upstream import url_has_credentials
from kvgate.metrics.definitions import ClientKeyMetrics

# The name of the key a request was admitted with (for the access log).
CLIENT_KEY = web.RequestKey("client_key", str)
_PROTECTED_PREFIX = "/v1/"


class TokenBucket:
    """`rate` tokens per second up to `burst`; a request takes one."""

    __slots__ = ("_rate", "_burst", "_tokens", "_updated")

    def __init__(self, rate: float, burst: int, now: float) -> None:
        self._rate = rate
        self._burst = burst
        self._tokens = float(burst)
        self._updated = now

    def take(self, now: float) -> float:
        """0 if a token was taken; otherwise the seconds until one will be available."""
        self._tokens = min(self._burst, self._tokens + (now - self._updated) * self._rate)
        self._updated = now
        if self._tokens >= 1:
            self._tokens -= 1
            return 0.0
        return (1 - self._tokens) / self._rate


@dataclass(slots=True)
class _KeyState:
    name: str
    secret: bytes
    bucket: TokenBucket | None
    inflight: int = 0


class ClientAuth:
    def __init__(
        self,
        keys: tuple[ApiKey, ...],
        settings: Settings,
        metrics: ClientKeyMetrics,
        failures: AuthFailureBudget,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        rate = settings.api_key_rate_limit_rps
        burst = settings.api_key_rate_limit_burst or max(1, math.ceil(rate))
        now = clock()
        self._keys = {
            _digest(header_bytes(k.key)): _KeyState(k.name, header_bytes(k.key),
                                                    TokenBucket(rate, burst, now) if rate else None)
            for k in keys
        }
        self._max_inflight = settings.api_key_max_inflight
        self._metrics = metrics
        self._failures = failures
        self._clock = clock

    def authenticate(self, authorization: str, address: str | None = None) -> _KeyState:
        self._failures.check(address, "api_key")
        scheme, _, presented = authorization.partition(" ")
        secret = header_bytes(presented.strip())
        state = self._keys.get(_digest(secret)) if scheme.lower() == "bearer" else None
        if state is None or not hmac.compare_digest(secret, state.secret):
            if secret:
                self._failures.failed(address, "api_key")  # 429 past the address's budget
            self._metrics.unauthorized.inc()
            raise APIError(401, "a valid API key is required: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        return state

    def admit(self, state: _KeyState) -> None:
        """Count the request against the key's limits, or refuse it with 429 and Retry-After."""
        if self._max_inflight and state.inflight >= self._max_inflight:
            self._refuse(state, "inflight_limited", 1.0,
                         f"API key '{state.name}' already has {state.inflight} requests in flight "
                         f"(the limit is {self._max_inflight})")
        if state.bucket is not None:
            wait_s = state.bucket.take(self._clock())
            if wait_s:
                self._refuse(state, "rate_limited", wait_s, f"API key '{state.name}' is over its rate limit")
        self._metrics.requests.labels(state.name, "accepted").inc()

    def _refuse(self, state: _KeyState, outcome: str, wait_s: float, message: str) -> None:
        self._metrics.requests.labels(state.name, outcome).inc()
        raise APIError(429, message, code=outcome, headers={"Retry-After": str(max(1, math.ceil(wait_s)))})

    def middleware(self):
        @web.middleware
        async def require_api_key(request: web.Request, handler: Handler) -> web.StreamResponse:
            if not request.path.startswith(_PROTECTED_PREFIX):
                return await handler(request)
            state = self.authenticate(request.headers.get("Authorization", ""), request.remote)
            request[CLIENT_KEY] = state.name
            self.admit(state)
            state.inflight += 1
            try:
                return await handler(request)
            finally:
                state.inflight -= 1

        return require_api_key


def engine_authorization(settings: Settings) -> Callable[[web.Request], str | None]:
    """What the Authorization header sent to engines is for a client request (None: no header)."""
    if settings.engine_api_key:
        fixed = f"Bearer {settings.engine_api_key}"
        return lambda request: fixed
    if settings.api_keys_file:
        return lambda request: None
    return lambda request: request.headers.get("Authorization")


def engine_refusal_is_the_gateways(settings: Settings) -> Callable[[str], bool]:
    """Whether an engine's 401/403 at an instance URL refuses credentials the gateway chose (its
    --engine-api-key, the URL's user:password, or none with --api-keys-file): then the instance is
    misconfigured, a failure to fail over from, not the client's problem to be relayed."""
    if settings.engine_api_key or settings.api_keys_file:
        return lambda url: True
    return url_has_credentials


def _digest(secret: bytes) -> bytes:
    return hashlib.sha256(secret).digest()
