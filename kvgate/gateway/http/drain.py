"""Graceful shutdown: on SIGTERM stop accepting, let requests in flight finish for a grace period,
then end the rest cleanly.

`drain(runner, grace_s)` in order:
1. closes the listening sockets (health checks of load balancers now fail) and the idle keep-alive
   connections (a connection busy with a request closes once its answer is sent); a /v1/*
   request already read but not yet started gets 503 `shutting_down`;
2. waits up to `grace_s` for every request in flight to finish (`hurry()`, a second signal, ends
   the wait at once);
3. cancels those left. Their handlers unwind as for a client hang-up (account entries released,
   engine connections closed, so engines abort the work), then a started stream gets an
   OpenAI-style error event and `data: [DONE]`, and a request not answered yet a 503.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from aiohttp import web

from kvgate.gateway.errors import APIError, Handler, error_response
from kvgate.gateway.http.relay import end_with_error
from kvgate.gateway.http.request_notes import OUTCOME, STREAMING_RESPONSE

log = logging.getLogger(__name__)

# After the grace period, how long cut handlers get to unwind (they only close sockets).
_CUT_UNWIND_S = 5.0
_SHUTDOWN_MESSAGE = "the gateway is shutting down; retry the request"


@dataclass(frozen=True, slots=True)
class DrainReport:
    finished: int  # requests in flight at SIGTERM that ended on their own within the grace period
    cut: int  # requests ended by the drain


class ShutdownDrain:
    def __init__(self) -> None:
        self.draining = False
        # Tasks running a request now (aiohttp runs a connection's requests in one task).
        self._active: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()  # a second SIGTERM/SIGINT: end the grace period now

    @property
    def inflight(self) -> int:
        return len(self._active)

    def hurry(self) -> None:
        """End the grace period at once (an operator's second signal)."""
        self._hurry.set()

    def middleware(self):
        @web.middleware
        async def track(request: web.Request, handler: Handler) -> web.StreamResponse:
            # Work is refused; probes and /metrics still answer.
            if self.draining and request.path.startswith("/v1/"):
                return _shutting_down()
            task = asyncio.current_task()
            assert task is not None
            self._active.add(task)
            self._idle.clear()
            try:
                return await handler(request)
            except asyncio.CancelledError:
                if task not in self._cut:
                    raise  # a client hang-up
                task.uncancel()
                return await _end_cut_request(request)
            finally:
                self._active.discard(task)
                self._cut.discard(task)
                if not self._active:
                    self._idle.set()

        return track

    async def drain(self, runner: web.AppRunner, grace_s: float) -> DrainReport:
        for site in list(runner.sites):
            await site.stop()
        if runner.server is not None:
            runner.server.pre_shutdown()  # close idle keep-alive connections now
        self.draining = True
        at_start = self.inflight
        log.info("draining: %d request(s) in flight, up to %.1f s to finish", at_start, grace_s)
        hurried = asyncio.ensure_future(self._hurry.wait())
        try:
            await self._wait_idle(grace_s, hurried)
        finally:
            hurried.cancel()
        left = list(self._active)
        for task in left:
            self._cut.add(task)
            task.cancel()
        if left:
            log.warning("drain: ending %d request(s) still in flight at the end of the grace period", len(left))
            await self._wait_idle(_CUT_UNWIND_S)
        return DrainReport(finished=at_start - len(left), cut=len(left))

    async def _wait_idle(self, timeout_s: float, or_until: asyncio.Future | None = None) -> None:
        idle = asyncio.ensure_future(self._idle.wait())
        await asyncio.wait([idle] + ([or_until] if or_until else []), timeout=timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)
        idle.cancel()


async def _end_cut_request(request: web.Request) -> web.StreamResponse:
    request[OUTCOME] = "shutdown"
    stream = request.get(STREAMING_RESPONSE)
    if stream is None:
        return _shutting_down()
    await end_with_error(stream, _SHUTDOWN_MESSAGE, status=503, code="shutting_down")
    return stream


def _shutting_down() -> web.Response:
    response = error_response(APIError(503, _SHUTDOWN_MESSAGE, code="shutting_down"))
    response.force_close()
    return response


DRAIN = web.AppKey("drain", ShutdownDrain)
