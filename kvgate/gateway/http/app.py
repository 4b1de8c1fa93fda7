"""The gateway's aiohttp application: wiring, lifecycle and the OpenAI routes.

`build_app(settings)` builds the core (core.py: it loads the tokenizer, so a bad --tokenizer fails
before serving) and returns an application whose parts that need a running loop (the upstream pool,
the forwarder, the fleet's background jobs) start with it and stop with it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgate.config.api_keys import load_api_keys
from kvgate.config.settings import Settings
from kvgate.gateway.auth_failures import AuthFailureBudget
from kvgate.gateway.core import EXPIRY_INTERVAL_S, build_gateway, plan_admitted, running_fleet
from kvgate.gateway.errors import error_middleware
from kvgate.gateway.http import access_log
from kvgate.gateway.http.auth import ClientAuth
from kvgate.gateway.http.client_timeout import body_timeout_middleware
from kvgate.gateway.http.drain import DRAIN, ShutdownDrain
from kvgate.gateway.http.forwarder import Forwarder
from kvgate.gateway.http.request_notes import MODEL, PLAN
from kvgate.gateway.http.upstream import UpstreamPool
from kvgate.gateway.operations.observe import REQUEST_ID, STREAM_BROKEN, observe_middleware
from kvgate.gateway.operations.routes import add_operational_routes
from kvgate.gateway.protocol import ParsedRequest, json_response, parse_chat, parse_completion
from kvgate.gateway.state import GATEWAY, Gateway
from kvgate.gateway.tracing import names
from kvgate.kvs_client import EmbeddedKVSIndex
from kvgate.metrics.definitions import GatewayMetrics, client_key_metrics

if TYPE_CHECKING:
    from kvgate.gateway.tracing.spans import RequestTrace
    from kvgate.gateway.worker_share import WorkerShare


# The HTTP door's forwarder, built when the application starts (it needs the running loop).
FORWARDER = web.AppKey("forwarder", Forwarder)


def build_app(
    settings: Settings,
    *,
    kvs_index: EmbeddedKVSIndex | None = None,
    tokenizer: Any = None,
    shared: WorkerShare | None = None,
) -> web.Application:
    """The gateway application. `kvs_index` replaces the configured KV store by an in-process index;
    `tokenizer` (a loaded Hugging Face tokenizer) saves loading one per gateway in tests and demos;
    `shared` makes it one worker of several (registry and account rows in shared memory)."""
    gateway = build_gateway(settings, kvs_index=kvs_index, tokenizer=tokenizer, shared=shared)
    drain = ShutdownDrain()
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=_middlewares(settings, gateway.metrics, gateway.prometheus, drain,
                                                   gateway.auth_failures, shared))
    app[GATEWAY] = gateway
    app[DRAIN] = drain
    if settings.access_log:
        access_log.enable(app)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    add_operational_routes(app, settings)
    app.cleanup_ctx.append(_lifecycle)
    if shared is not None:
        app.on_response_prepare.append(shared.tag_response)
    return app


def _middlewares(settings: Settings, metrics: GatewayMetrics, prometheus: CollectorRegistry,
                 drain: ShutdownDrain, auth_failures: AuthFailureBudget, shared: WorkerShare | None) -> list:
    """Outermost first: name and count the request, log it, track it for the drain, turn errors
    into OpenAI JSON, check the client's API key, then make sure the body arrives in time."""
    chain = [observe_middleware(metrics)]
    if settings.access_log:
        chain.append(access_log.access_log_middleware)
    chain += [drain.middleware(), error_middleware]
    if settings.api_keys_file:
        auth = ClientAuth(load_api_keys(settings.api_keys_file), settings, client_key_metrics(prometheus),
                          auth_failures, shared=shared)
        chain.append(auth.middleware())
    chain.append(body_timeout_middleware(settings.client_request_timeout_s))
    return chain


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    settings = gateway.settings
    # Requests go through the lean upstream pool.
    upstream = UpstreamPool(settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s)
    gateway.registry.on_eject = lambda state: upstream.abort_waiting(state.config.url, f"{state.id} was ejected")
    app[FORWARDER] = Forwarder(upstream, settings, gateway.registry, gateway.metrics, gateway.feedback,
                               decode_ledger=gateway.decode_ledger, prfaas=gateway.prfaas)

    async def close_idle() -> None:  # connections past their keep-alive
        upstream.close_idle()

    try:
        async with running_fleet(gateway, [(EXPIRY_INTERVAL_S, close_idle, "idle connections")]):
            yield
    finally:
        upstream.close()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat)


async def _serve(request: web.Request, parse: Callable[[bytes], ParsedRequest]) -> web.StreamResponse:
    arrived = time.perf_counter()
    gateway = request.app[GATEWAY]
    if gateway.tracing is not None:
        return await _serve_traced(request, parse, gateway, arrived)
    return await _answer(request, parse, gateway, arrived, None)


async def _answer(request: web.Request, parse: Callable[[bytes], ParsedRequest], gateway: Gateway, arrived: float,
                  trace: RequestTrace | None) -> web.StreamResponse:
    parsed = parse(await request.read())
    request[MODEL] = parsed.model
    if trace is not None:
        trace.parsed(parsed)
    plan = request[PLAN] = await plan_admitted(gateway, parsed, trace)
    return await request.app[FORWARDER].forward(request, parsed, plan, request[REQUEST_ID], arrived, trace)


async def _serve_traced(request: web.Request, parse: Callable[[bytes], ParsedRequest], gateway: Gateway,
                        arrived: float) -> web.StreamResponse:
    """The request under its server span, which continues the client's traceparent (if any)."""
    from kvgate.gateway.tracing.spans import RequestTrace

    assert gateway.tracing is not None
    attributes = {names.REQUEST_ID: request[REQUEST_ID], names.FRONT_DOOR: "http",
                  names.CLIENT_ADDRESS: request.remote or "", names.USER_AGENT: request.headers.get("User-Agent", "")}
    with RequestTrace(gateway.tracing, request.method, request.path, request.path, request.headers, arrived,
                      attributes) as trace:
        response = await _answer(request, parse, gateway, arrived, trace)
        trace.answered(response.status, names.STREAM_BROKEN if STREAM_BROKEN in request else None)
        return response


async def _models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data = [{"id": model, "object": "model", "created": gateway.started, "owned_by": "kvgate"}
            for model in gateway.registry.models()]
    return json_response({"object": "list", "data": data})
