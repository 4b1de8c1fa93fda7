"""The routes every front door's HTTP side serves for operators: readiness (/health), liveness
(/livez), /metrics, /debug/schedule and the admin routes."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvgate.config.settings import DebugRoutes, Settings
from kvgate.gateway.operations import admin, debug
from kvgate.gateway.protocol import json_response
from kvgate.gateway.state import GATEWAY


def add_operational_routes(app: web.Application, settings: Settings) -> None:
    """Health, metrics, /debug/schedule and the admin routes: the same on every front door's HTTP side."""
    app.router.add_get("/health", _health)
    app.router.add_get("/livez", _livez)
    if settings.debug_routes is not DebugRoutes.OFF:
        guard = admin.admin_only if settings.debug_routes is DebugRoutes.ADMIN else None
        app.router.add_get("/metrics", guard(_metrics) if guard else _metrics)
        debug.add_routes(app, settings.debug_max_concurrent, guard)
    admin.add_routes(app)


async def _health(request: web.Request) -> web.Response:
    """Readiness: 503 while no instance can take a request, so load balancers send traffic
    elsewhere; the body says why. (While draining, the listening socket is already closed.) Instances
    routed to in panic (all of their model ejected, registry.py) count as routable: they are tried."""
    states = request.app[GATEWAY].registry.states()
    routable = sum(1 for s in states if s.routable)
    body = {"status": "ok", "instances": len(states), "routable_instances": routable,
            "panic_instances": sum(1 for s in states if s.panic)}
    if not routable:
        reason = "no instance configured" if not states else "no instance is routable (all ejected or draining)"
        return json_response({**body, "status": "unavailable", "reason": reason}, status=503)
    return json_response(body)


async def _livez(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP, whatever the instances' state."""
    return json_response({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    if gateway.shared is not None:
        body = gateway.shared.whole_metrics(gateway.registry)
    else:
        body = generate_latest(gateway.prometheus)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

