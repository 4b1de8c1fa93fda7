"""Relay an engine's answer to the client: whole JSON answers and SSE streams, cut at event ends.

Every path that answers a client from an engine (a whole request, or the decode half of a
prefill/decode hand-off) relays through here, so streaming behaves the same on all of them:
- A whole answer (JSON, a relayed 4xx) is read completely before anything is sent, so a break
  half-way is still the caller's to retry.
- A stream is relayed chunk by chunk and cut only at event boundaries, so a failure never splits
  an event: after the first byte an upstream failure ends the stream with an OpenAI-style error
  event and `data: [DONE]`; before it, `RetryableFailure` tells the caller another instance may
  answer.
- A `UsageTap` (usage.py), when given, reads the engine's usage report on the way and removes the
  usage chunk the gateway asked for on the client's behalf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import orjson
from aiohttp import web

from kvgate.gateway.errors import APIError, error_payload
from kvgate.gateway.request_notes import STREAMING_RESPONSE
from kvgate.gateway.upstream import FirstByteTimeout, UpstreamError, UpstreamResponse
from kvgate.gateway.usage import UsageTap

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"
# TimeoutError and connection failures are OSErrors.
UPSTREAM_ERRORS = (OSError, UpstreamError)
SSE_DONE = b"data: [DONE]\n\n"
# Set on a request whose stream the engine broke after the first byte: it went out as 200, but
# the metrics and the outlier detector must count it as the failure it was.
STREAM_BROKEN = web.RequestKey("stream_broken", str)


class RetryableFailure(Exception):
    """The attempt failed before the client received anything: another instance may answer."""


async def relay_answer(
    request: web.Request,
    upstream: UpstreamResponse,
    request_id: str,
    on_first_byte: Callable[[], None],
    tap: UsageTap | None = None,
) -> web.StreamResponse:
    """The engine's answer as the client's. `upstream.status` is below 500 (5xx is the caller's)."""
    if upstream.status != 200 or upstream.media_type != "text/event-stream":
        body = await upstream.read()
        on_first_byte()
        if tap is not None and upstream.status == 200 and not upstream.content_encoding:
            tap.whole(body)
        headers = {"Content-Type": upstream.content_type or "application/json", REQUEST_ID_HEADER: request_id}
        if upstream.content_encoding:
            headers["Content-Encoding"] = upstream.content_encoding
        return web.Response(status=upstream.status, body=body, headers=headers)
    return await relay_stream(request, upstream, request_id, on_first_byte, tap)


async def relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    request_id: str,
    on_first_byte: Callable[[], None],
    tap: UsageTap | None = None,
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    pending = b""  # bytes of an event not yet complete
    while True:
        try:
            chunk = await upstream.read_chunk()
        except UPSTREAM_ERRORS as exc:
            if response is None:
                raise RetryableFailure(describe(exc)) from None
            request[STREAM_BROKEN] = describe(exc)
            await end_with_error(response, f"the engine failed mid-stream: {describe(exc)}")
            return response
        if not chunk:
            break
        if response is None:
            on_first_byte()
            response = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                         REQUEST_ID_HEADER: request_id}
            )
            await response.prepare(request)
            request[STREAMING_RESPONSE] = response
        pending += chunk
        cut = _events_end(pending)
        if cut:
            events = pending[:cut] if tap is None else tap.events(pending[:cut])
            if events and not await _write(response, events):
                return response
            pending = pending[cut:]
    if response is None:
        raise RetryableFailure("the engine closed the stream without sending anything")
    if tap is not None:
        pending = tap.end(pending)
    if pending and not await _write(response, pending):
        return response
    await response.write_eof()
    return response


def _events_end(buffer: bytes) -> int:
    """Index just past the last complete SSE event in `buffer` (0 if none is complete)."""
    lf, crlf = buffer.rfind(b"\n\n"), buffer.rfind(b"\r\n\r\n")
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)


async def _write(response: web.StreamResponse, data: bytes) -> bool:
    """False when the client is gone (the handler is usually cancelled before we get here)."""
    try:
        await response.write(data)
    except ConnectionResetError:
        return False
    return True


async def end_with_error(
    response: web.StreamResponse, message: str, status: int = 502, code: str = "upstream_stream_error"
) -> None:
    event = b"data: " + orjson.dumps(error_payload(status, message, code=code)) + b"\n\n"
    if await _write(response, event + SSE_DONE):
        await response.write_eof()


def unavailable(request_id: str, failures: Sequence[str], tried: str = "instance") -> APIError:
    """The 502 for a request no instance could answer. Engines' answers can hold tracebacks and
    internals, so the client gets the request id and the details go to the log."""
    log.warning("request %s: no %s could answer: %s", request_id, tried, "; ".join(failures))
    return APIError(502, f"no {tried} could answer the request (request id {request_id}; the gateway log "
                         "has the details)", code="upstream_unavailable")


def describe(exc: BaseException) -> str:
    if isinstance(exc, FirstByteTimeout):
        return "no first byte within --upstream-first-byte-timeout-s"
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
