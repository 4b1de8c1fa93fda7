"""The outermost middleware: give every request an id and count every answer by route and status."""

from __future__ import annotations

import asyncio
import uuid

from aiohttp import web

from kvgate.gateway.errors import Handler
from kvgate.gateway.forwarder import REQUEST_ID_HEADER
from kvgate.metrics.definitions import GatewayMetrics

REQUEST_ID = web.RequestKey("request_id", str)
# nginx's convention for "the client closed the connection before the answer was complete".
CLIENT_CLOSED = "499"


def observe_middleware(metrics: GatewayMetrics):
    @web.middleware
    async def observe(request: web.Request, handler: Handler) -> web.StreamResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex
        request[REQUEST_ID] = request_id
        resource = request.match_info.route.resource
        # Unmatched paths share one label so scanners cannot blow up the metric's cardinality.
        route = resource.canonical if resource is not None else "unmatched"
        try:
            response = await handler(request)
        except asyncio.CancelledError:
            metrics.requests.labels(route, CLIENT_CLOSED).inc()
            raise
        if not response.prepared:
            response.headers.setdefault(REQUEST_ID_HEADER, request_id)
        metrics.requests.labels(route, str(response.status)).inc()
        return response

    return observe
