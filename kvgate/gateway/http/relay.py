"""Relay an engine's answer to the client: whole JSON answers and SSE streams, cut at event ends.

Every path that answers a client from an engine (a whole request, or the decode half of a
prefill/decode hand-off) relays through here, so streaming behaves the same on all of them:
- A whole answer (JSON, a relayed 4xx) is read completely before anything is sent, so a break
  half-way is still the caller's to retry.
- A stream is relayed chunk by chunk and cut only at event boundaries, so a failure never splits
  an event: after the first byte an upstream failure, an event longer than --max-sse-event-bytes
  or a stream that ends without `data: [DONE]` (the engine died between events) ends the stream
  with an OpenAI-style error event and `data: [DONE]`; before it, `RetryableFailure` tells the
  caller another instance may answer.
- A `UsageTap` (usage.py), when given, reads the engine's usage report on the way and removes the
  usage chunk the gateway asked for on the client's behalf.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence

import orjson
from aiohttp import web

from kvgate.gateway.errors import APIError, error_payload
from kvgate.gateway.feedback.usage import UsageTap, events_end
from kvgate.gateway.http.request_notes import STREAMING_RESPONSE
from kvgate.gateway.http.upstream import FirstByteTimeout, UpstreamError, UpstreamResponse
from kvgate.gateway.operations.observe import REQUEST_ID_HEADER, STREAM_BROKEN

log = logging.getLogger(__name__)

# TimeoutError and connection failures are OSErrors.
UPSTREAM_ERRORS = (OSError, UpstreamError)
SSE_DONE = b"data: [DONE]\n\n"
_DONE_AT_END = re.compile(rb"(?:^|\n)data: ?\[DONE\]\s*$")
_TAIL_BYTES = 32


class RetryableFailure(Exception):
    """The attempt failed before the client received anything: another instance may answer."""


async def relay_answer(
    request: web.Request,
    upstream: UpstreamResponse,
    request_id: str,
    on_first_byte: Callable[[], None],
    tap: UsageTap | None,
    max_event_bytes: int,
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
    return await relay_stream(request, upstream, request_id, on_first_byte, tap, max_event_bytes)


async def relay_stream(
    request: web.Request,
    upstream: UpstreamResponse,
    request_id: str,
    on_first_byte: Callable[[], None],
    tap: UsageTap | None,
    max_event_bytes: int,
) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    # Bytes of an event not yet complete. A bytearray grown in place, searched only where new bytes
    # came: an engine that never ends its event costs linear time, not a copy of the buffer per chunk.
    pending = bytearray()
    relayed_tail = b""  # the last bytes of the complete events relayed, to tell whether [DONE] came
    while True:
        try:
            chunk = await upstream.read_chunk()
        except UPSTREAM_ERRORS as exc:
            if response is None:
                raise RetryableFailure(describe(exc)) from None
            return await _broken(request, response, f"the engine failed mid-stream: {describe(exc)}")
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
        if not pending and chunk.endswith(b"\n\n"):  # the usual chunk: whole events, nothing held back
            complete = chunk
        else:
            searched = max(0, len(pending) - 3)  # a separator may straddle the old end and the new bytes
            pending += chunk
            cut = events_end(pending, searched)
            complete = bytes(pending[:cut])
            del pending[:cut]
        if complete:
            relayed_tail = (relayed_tail + complete[-_TAIL_BYTES:])[-_TAIL_BYTES:]
            events = complete if tap is None else tap.events(complete)
            if events and not await _write(response, events):
                return response
        if len(pending) > max_event_bytes:
            return await _broken(request, response, f"the engine sent an SSE event longer than {max_event_bytes} "
                                 "bytes (--max-sse-event-bytes)", code="upstream_event_too_large")
    if response is None:
        raise RetryableFailure("the engine closed the stream without sending anything")
    rest = bytes(pending)
    if not _ends_with_done(relayed_tail + rest):
        # The engine stopped without its last word; an unfinished event is dropped, not half-relayed.
        return await _broken(request, response, "the engine ended the stream without data: [DONE]",
                             code="upstream_stream_incomplete")
    if tap is not None:
        rest = tap.end(rest)
    if rest and not await _write(response, rest):
        return response
    await response.write_eof()
    return response


async def _broken(request: web.Request, response: web.StreamResponse, message: str,
                  code: str = "upstream_stream_error") -> web.StreamResponse:
    """End a stream the engine broke after its first byte: an error event the client sees, and a mark
    for the metrics and the outlier detector (the answer went out as 200)."""
    request[STREAM_BROKEN] = message
    await end_with_error(response, message, code=code)
    return response


def _ends_with_done(data: bytes) -> bool:
    return _DONE_AT_END.search(data[-_TAIL_BYTES:]) is not None


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
        # Streams wait --upstream-first-byte-timeout-s, whole answers --upstream-whole-answer-timeout-s.
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
