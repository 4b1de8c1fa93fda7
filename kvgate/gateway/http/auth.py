"""Client access control on /v1/*: API keys, a per-key rate limit and a per-key in-flight cap.

Off unless --api-keys-file is set. Then every /v1/* request needs `Authorization: Bearer <key>`
(401 otherwise); each key may start `--api-key-rate-limit-rps` requests per second with a burst of
`--api-key-rate-limit-burst`, and hold `--api-key-max-inflight` requests at once (429 with
Retry-After beyond either); with workers, those limits are the whole gateway's (key_limits.py).
Only the key's name reaches logs and metrics.

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
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from kvgate.config.api_keys import ApiKey
from kvgate.config.settings import Settings
from kvgate.gateway.auth_failures import AuthFailureBudget, header_bytes
from kvgate.gateway.errors import APIError, Handler
from kvgate.gateway.http.key_limits import KeyLimit, LocalKeyLimit, TokenBucket
from kvgate.gateway.http.upstream import url_has_credentials
from kvgate.metrics.definitions import ClientKeyMetrics

if TYPE_CHECKING:
    from kvgate.gateway.worker_share import WorkerShare

log = logging.getLogger(__name__)

# The name of the key a request was admitted with (for the access log).
CLIENT_KEY = web.RequestKey("client_key", str)
_PROTECTED_PREFIX = "/v1/"


@dataclass(slots=True)
class _KeyState:
    name: str
    secret: bytes
    limit: KeyLimit


class ClientAuth:
    def __init__(
        self,
        keys: tuple[ApiKey, ...],
        settings: Settings,
        metrics: ClientKeyMetrics,
        failures: AuthFailureBudget,
        clock: Callable[[], float] = time.monotonic,
        shared: WorkerShare | None = None,
    ) -> None:
        """`shared`: the limits are counted with the other workers of the gateway (time.monotonic is
        the whole machine's clock, so their buckets agree)."""
        rate = settings.api_key_rate_limit_rps
        burst = settings.api_key_rate_limit_burst or max(1, math.ceil(rate))
        now = clock()
        self._keys: dict[bytes, _KeyState] = {}
        unshared = []
        for key in keys:
            secret = header_bytes(key.key)
            digest = _digest(secret)
            limit = shared.key_limit(digest, rate, burst, now) if shared is not None else None
            if limit is None:
                limit = LocalKeyLimit(TokenBucket(rate, burst, now) if rate else None)
                unshared.append(key.name)
            self._keys[digest] = _KeyState(key.name, secret, limit)
        if shared is not None and unshared:
            log.warning("no room in the workers' shared key limits for API keys %s (keys added since the gateway "
                        "started): each worker counts their limits alone until the gateway restarts",
                        ", ".join(unshared))
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
        """Count the request in the key's flight and against its rate, or refuse it with 429 and
        Retry-After. Admitted, the caller ends it with `state.limit.leave()`."""
        # Counted first, then checked: two workers admitting at once may both refuse, never both
        # pass the limit.
        inflight = state.limit.enter()
        if self._max_inflight and inflight > self._max_inflight:
            self._refuse(state, "inflight_limited", 1.0,
                         f"API key '{state.name}' already has {inflight - 1} requests in flight "
                         f"(the limit is {self._max_inflight})")
        wait_s = state.limit.take(self._clock())
        if wait_s:
            self._refuse(state, "rate_limited", wait_s, f"API key '{state.name}' is over its rate limit")
        self._metrics.requests.labels(state.name, "accepted").inc()

    def _refuse(self, state: _KeyState, outcome: str, wait_s: float, message: str) -> None:
        state.limit.leave()
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
            try:
                return await handler(request)
            finally:
                state.limit.leave()

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
