"""The outermost middleware: give every request an id and count every answer by route and status.

A client's own `X-Request-Id` is kept only if it is short printable ASCII (`client_request_id`):
the id goes into logs, metrics-adjacent JSON and the header sent to engines, so 8 KB of text or
bytes that are not UTF-8 would break or bloat all of them. Any other value is replaced by one of
the gateway's own ids.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import secrets
from collections.abc import Callable

from aiohttp import web

from kvgate.gateway.errors import Handler
from kvgate.metrics.children import Children
from kvgate.metrics.definitions import GatewayMetrics

REQUEST_ID = web.RequestKey("request_id", str)
# nginx's convention for "the client closed the connection before the answer was complete".
CLIENT_CLOSED = "499"
# A stream sent as 200 that the engine broke after its first byte (ended with an error event).
STREAM_ERROR = "stream_error"
MAX_REQUEST_ID_CHARS = 128
# Visible ASCII: no spaces, no control characters, nothing a log or header line must escape.
_CLIENT_REQUEST_ID = re.compile(rf"[!-~]{{1,{MAX_REQUEST_ID_CHARS}}}")


REQUEST_ID_HEADER = "X-Request-Id"
# Set on a request whose stream the engine broke after the first byte: it went out as 200, but
# the metrics and the outlier detector must count it as the failure it was.
STREAM_BROKEN = web.RequestKey("stream_broken", str)
def client_request_id(value: str | None) -> str | None:
    """The client's X-Request-Id if it is usable as it stands; None otherwise (aiohttp decodes header
    bytes that are not UTF-8 to surrogates, which the pattern refuses)."""
    return value if value is not None and _CLIENT_REQUEST_ID.fullmatch(value) else None


def request_ids() -> Callable[[], str]:
    """Unique ids of 32 hex digits: a random per-process half, then a counter. They label logs and
    engine requests and need not be unguessable, so no system call (urandom) per request."""
    prefix = secrets.token_hex(8)
    counter = itertools.count()
    return lambda: f"{prefix}{next(counter):016x}"


def observe_middleware(metrics: GatewayMetrics):
    new_request_id = request_ids()
    requests = Children(metrics.requests)  # by route and status

    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = client_request_id(request.headers.get(REQUEST_ID_HEADER)) or new_request_id()
        request[REQUEST_ID] = request_id
        resource = request.match_info.route.resource
        # Unmatched paths share one label so scanners cannot blow up the metric's cardinality.
        route = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            requests(route, CLIENT_CLOSED).inc()
            raise
        if not response.prepared:
            response.headers.setdefault(REQUEST_ID_HEADER, request_id)
        requests(route, STREAM_ERROR if STREAM_BROKEN in request else str(response.status)).inc()
        return response

    return observe
