"""The endpoint picker's processes: the ext_proc gRPC service with gRPC health, and its HTTP side.

gRPC (settings.host:settings.port): `envoy.service.ext_proc.v3.ExternalProcessor` and `grpc.health.v1`
(the empty service name is liveness: SERVING while the process runs; the ExternalProcessor's name is
readiness: SERVING while an instance is routable, as GET /health). HTTP (settings.host:epp_http_port):
/metrics, /health, /livez, /debug/schedule and /admin/*, the same routes as `kvgate serve`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from kvgate.config.settings import Settings
from kvgate.gateway.core import build_gateway, running_fleet, tune_gc
from kvgate.gateway.errors import error_middleware
from kvgate.gateway.ext_proc.exchange import Exchange
from kvgate.gateway.operations.observe import observe_middleware, request_ids
from kvgate.gateway.operations.routes import add_operational_routes
from kvgate.gateway.state import GATEWAY, Gateway
from kvgate.kvs_client import EmbeddedKVSIndex

log = logging.getLogger(__name__)

READINESS_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
_READINESS_INTERVAL_S = 1.0
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class EndpointPicker(external_processor_pb2_grpc.ExternalProcessorServicer):
    """One `Process` stream per HTTP request Envoy processes."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._request_ids = request_ids()
        # Account keys are the picker's own: clients may reuse an x-request-id concurrently.
        sequence = itertools.count()
        self._account_key = lambda request_id: f"{request_id}#{next(sequence)}"

    async def Process(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[ProcessingRequest], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[ProcessingResponse]:
        exchange = Exchange(self._gateway, self._request_ids, self._account_key)
        try:
            async for message in request_iterator:
                for response in await exchange.handle(message):
                    yield response
        finally:  # also when Envoy cancels the stream (a client reset): the generator is closed
            exchange.close()


@dataclass
class PickerHandle:
    """A running endpoint picker: `grpc_address` for Envoy, `http_url` for its HTTP side."""

    grpc_address: str
    http_url: str
    gateway: Gateway
    server: grpc.aio.Server
    runner: web.AppRunner
    fleet: contextlib.AsyncExitStack

    async def close(self, grace_s: float | None = None) -> None:
        """Stop taking streams, let open ones finish for `grace_s`, then stop the fleet's jobs."""
        await self.server.stop(grace_s)
        await self.runner.cleanup()
        await self.fleet.aclose()


async def start_picker(settings: Settings, *, kvs_index: EmbeddedKVSIndex | None = None,
                       tokenizer: Any = None) -> PickerHandle:
    """Serve the picker on settings.host:settings.port (gRPC) and settings.host:epp_http_port (HTTP);
    port 0 picks a free one."""
    gateway = build_gateway(settings, kvs_index=kvs_index, tokenizer=tokenizer)
    health = health_aio.HealthServicer()
    await health.set("", _SERVING)

    async def readiness() -> None:
        routable = any(state.routable for state in gateway.registry.states())
        await health.set(READINESS_SERVICE, _SERVING if routable else _NOT_SERVING)

    await readiness()
    fleet = contextlib.AsyncExitStack()
    await fleet.enter_async_context(running_fleet(gateway, [(_READINESS_INTERVAL_S, readiness, "readiness")]))
    try:
        server = grpc.aio.server()
        external_processor_pb2_grpc.add_ExternalProcessorServicer_to_server(EndpointPicker(gateway), server)
        health_pb2_grpc.add_HealthServicer_to_server(health, server)
        port = server.add_insecure_port(f"{settings.host}:{settings.port}")
        if not port:
            raise OSError(f"cannot listen on {settings.host}:{settings.port} (gRPC)")
        await server.start()
        runner = await _start_http_side(gateway)
    except BaseException:
        await fleet.aclose()
        raise
    host, http_port = runner.addresses[0][:2]
    return PickerHandle(f"{settings.host}:{port}", f"http://{host}:{http_port}", gateway, server, runner, fleet)


async def _start_http_side(gateway: Gateway) -> web.AppRunner:
    settings = gateway.settings
    app = web.Application(middlewares=[observe_middleware(gateway.metrics), error_middleware])
    app[GATEWAY] = gateway
    add_operational_routes(app, settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, settings.host, settings.epp_http_port).start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


def run_picker(settings: Settings, tokenizer: Any = None) -> int:
    """Serve until SIGINT/SIGTERM, then let open streams finish for --shutdown-grace-s."""
    return asyncio.run(_serve_forever(settings, tokenizer))


async def _serve_forever(settings: Settings, tokenizer: Any) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    handle = await start_picker(settings, tokenizer=tokenizer)
    tune_gc()  # as `kvgate serve` does: start-up's objects out of the collector's sight
    log.info("kvgate endpoint picker: ext_proc gRPC on %s, HTTP on %s, %d instance(s), policy %s",
             handle.grpc_address, handle.http_url, len(settings.instances), settings.effective_policy)
    print(f"kvgate epp listening on {handle.grpc_address} (gRPC), {handle.http_url} (HTTP)", flush=True)
    try:
        await stop.wait()
    finally:
        await handle.close(settings.shutdown_grace_s)
        log.info("stopped; in-flight account entries left: %d", handle.gateway.account.total_inflight())
    return 0
