"""Requests the HTTP parser refuses (bad header bytes, a header over its size limit, more than
aiohttp's header count), answered like every other error and logged without a traceback.

aiohttp answers them itself, before any route or middleware runs, with a plain-text 400 and a
traceback in the log per request: any client could flood the log. Here they get the gateway's
OpenAI-style JSON error (the connection is closed, as HTTP requires after a framing error), a count
in `kvgate_malformed_requests{reason}` and at most one log line per interval.

aiohttp offers no option for this: the runner's server is made to build handlers of a subclass
whose `handle_error` answers parser errors (`answer_malformed_requests`). Other errors (a
handler's unexpected exception, already turned into JSON by the error middleware) keep aiohttp's path.
"""

from __future__ import annotations

import logging
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestHandler
from prometheus_client import Counter

from kvgate.gateway.errors import APIError, error_response
from kvgate.gateway.log_throttle import LogThrottle

log = logging.getLogger(__name__)


class _Handler(RequestHandler):
    __slots__ = ()

    def handle_error(self, request: Any, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        manager = self._manager
        if (not isinstance(exc, HttpProcessingError) or not 400 <= status < 500
                or not isinstance(manager, _Server) or request.writer.output_size > 0):
            return super().handle_error(request, status, exc, message)
        reason = _reason(exc)
        manager.malformed.labels(reason).inc()
        manager.throttle.warning("malformed HTTP request from %s refused (%s): %s", request.remote, reason,
                                 _one_line(exc))
        response = error_response(APIError(status, f"malformed HTTP request ({reason}): {_one_line(exc)}",
                                           code="malformed_request"))
        response.force_close()
        return response


class _Server(web.Server):
    malformed: Counter
    throttle: LogThrottle

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)


def answer_malformed_requests(runner: web.AppRunner, malformed: Counter) -> None:
    """Call after `runner.setup()` and before its site starts."""
    server = runner.server
    assert server is not None and type(server) is web.Server, "the runner is not set up"
    server.__class__ = _Server
    assert isinstance(server, _Server)
    server.malformed = malformed
    server.throttle = LogThrottle(log)


def _reason(exc: HttpProcessingError) -> str:
    if isinstance(exc, LineTooLong):
        return "header_too_long"
    text = str(exc).lower()
    if "too many headers" in text:
        return "too_many_headers"
    return "bad_request"


def _one_line(exc: BaseException, limit: int = 200) -> str:
    """aiohttp's messages quote the offending bytes over several lines: one short line of them."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[:limit] + "..."
