"""Run the gateway: in the caller's event loop (`start_gateway`, for the demo, benchmarks and
tests) or as the process's main loop (`run_gateway`, for `kvgate serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aiohttp import web

from kvgate.config.settings import Settings
from kvgate.gateway.core import tune_gc
from kvgate.gateway.http.app import build_app
from kvgate.gateway.http.drain import DRAIN, DrainReport
from kvgate.gateway.http.malformed import answer_malformed_requests
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client import EmbeddedKVSIndex

if TYPE_CHECKING:
    from kvgate.gateway.worker_share import WorkerShare

log = logging.getLogger(__name__)



@dataclass
class GatewayHandle:
    url: str
    app: web.Application
    runner: web.AppRunner

    async def close(self) -> None:
        await self.runner.cleanup()

    async def drain(self, grace_s: float) -> DrainReport:
        """Stop accepting and let requests in flight finish for `grace_s`, then end the rest
        (gateway/http/drain.py); `close()` follows."""
        return await self.app[DRAIN].drain(self.runner, grace_s)


async def start_gateway(
    settings: Settings,
    *,
    kvs_index: EmbeddedKVSIndex | None = None,
    tokenizer: Any = None,
    shared: WorkerShare | None = None,
) -> GatewayHandle:
    """Serve a gateway on settings.host:settings.port (port 0 picks a free one; see handle.url).
    A worker of several (`shared`) binds the port beside its peers (SO_REUSEPORT)."""
    app = build_app(settings, kvs_index=kvs_index, tokenizer=tokenizer, shared=shared)
    # Handler cancellation: a client hang-up cancels its handler, which closes the upstream call.
    # keepalive_timeout is also the header-read timeout (gateway/http/client_timeout.py).
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None,
                           keepalive_timeout=settings.client_request_timeout_s)
    await runner.setup()
    answer_malformed_requests(runner, app[GATEWAY].metrics.malformed_requests)
    site = web.TCPSite(runner, settings.host, settings.port, backlog=1024, reuse_port=shared is not None)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    host, port = runner.addresses[0][:2]
    return GatewayHandle(f"http://{host}:{port}", app, runner)


def run_gateway(
    settings: Settings,
    tokenizer: Any = None,
    *,
    shared: WorkerShare | None = None,
    on_ready: Callable[[], None] | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM, then drain (--shutdown-grace-s); uvloop when installed. A worker
    passes its `shared` parts and is told `on_ready` once it listens."""
    serve = _serve_forever(settings, tokenizer, shared, on_ready)
    try:
        import uvloop
    except ImportError:
        return asyncio.run(serve)
    return uvloop.run(serve)


async def _serve_forever(
    settings: Settings, tokenizer: Any, shared: WorkerShare | None, on_ready: Callable[[], None] | None
) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(sig, stop.set)
    handle = await start_gateway(settings, tokenizer=tokenizer, shared=shared)
    tune_gc()
    log.info("kvgate gateway listening on %s with %d instance(s), policy %s, event loop %s",
             handle.url, len(settings.instances), settings.effective_policy, type(loop).__module__)
    if on_ready is not None:
        on_ready()
    else:  # with workers, the supervisor says it once for all of them
        print(f"kvgate gateway listening on {handle.url}", flush=True)
    try:
        await stop.wait()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, handle.app[DRAIN].hurry)
        report = await handle.drain(settings.shutdown_grace_s)
        log.info("drained: %d request(s) finished, %d ended by the drain; in-flight account entries left: %d",
                 report.finished, report.cut, handle.app[GATEWAY].account.total_inflight())
    finally:
        await handle.close()
    return 0
