"""Send a planned request to an engine and relay the answer to the client as it arrives.

Rules, in the order a request meets them:
- Instances are tried in the decision's ranking, at most 1 + `forward_retries` of them, never the
  same one twice. A connection error, a 5xx or a broken answer *before the client has received a
  byte* moves on to the next; a 4xx is the client's problem and is relayed, never retried.
- Streams (SSE) are relayed chunk by chunk, cut only at event boundaries so an event is never
  split by a failure: after the first byte, an upstream failure ends the stream with an
  OpenAI-style error event and `data: [DONE]`.
- A client that hangs up cancels the handler (aiohttp handler cancellation): the upstream
  connection is closed at once, which makes the engine abort the request.
- Each attempt owns one account entry, released on every exit path (finally).
"""

from __future__ import annotations

import itertools
import time

import orjson
from aiohttp import web

from kvgate.config.settings import Settings
from kvgate.gateway.errors import APIError, error_payload
from kvgate.gateway.inflight import InflightTracker
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.registry import InstanceRegistry
from kvgate.gateway.routing import RoutePlan
from kvgate.gateway.upstream import UpstreamError, UpstreamPool, UpstreamResponse
from kvgate.metrics.definitions import GatewayMetrics

REQUEST_ID_HEADER = "X-Request-Id"
# TimeoutError and connection failures are OSErrors.
_UPSTREAM_ERRORS = (OSError, UpstreamError)
# Client headers an engine may need (its own API key); everything else stays at the gateway.
_PASSED_HEADERS = ("Authorization",)
_SSE_DONE = b"data: [DONE]\n\n"
_FIXED_HEADERS = "Content-Type: application/json\r\nUser-Agent: kvgate\r\n"


class _RetryableFailure(Exception):
    """The attempt failed before the client received anything: another instance may answer."""


class Forwarder:
    def __init__(
        self,
        upstream: UpstreamPool,
        settings: Settings,
        registry: InstanceRegistry,
        tracker: InflightTracker,
        metrics: GatewayMetrics,
    ) -> None:
        self._upstream = upstream
        self._registry = registry
        self._tracker = tracker
        self._metrics = metrics
        self._max_attempts = 1 + settings.forward_retries
        self._forward_token_ids = settings.forward_token_ids
        # Account keys are the gateway's own: clients may reuse an x-request-id concurrently.
        self._sequence = itertools.count()

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, plan: RoutePlan, request_id: str, arrived: float
    ) -> web.StreamResponse:
        path = "/v1/chat/completions" if parsed.chat else "/v1/completions"
        payload = self._payload(parsed, plan)
        headers = _upstream_headers(request, request_id)

        failures: list[str] = []
        last_failed: str | None = None
        attempts = 0
        for instance_id in plan.decision.ranking:
            if attempts == self._max_attempts:
                break
            state = self._registry.get(instance_id)
            # Retries skip instances removed, drained or ejected since the decision.
            if state is None or (attempts and not state.routable):
                continue
            attempts += 1
            if last_failed is not None:
                self._metrics.forward_retries.labels(last_failed).inc()
            key = f"{request_id}#{next(self._sequence)}"
            self._tracker.dispatch(key, instance_id, plan.miss_tokens(instance_id))
            if attempts == 1:
                self._observe_hit_ratio(plan, instance_id)
            try:
                response = await self._attempt(request, key, state.config.url, path, payload, headers, request_id,
                                               arrived)
            except _RetryableFailure as failure:
                failures.append(f"{instance_id}: {failure}")
                last_failed = instance_id
                continue
            finally:
                self._tracker.release(key)
            self._metrics.e2e_seconds.observe(time.perf_counter() - arrived)
            return response
        if not failures:
            raise APIError(503, f"no healthy instance serves '{parsed.model}'", code="no_healthy_instance")
        raise APIError(502, "no instance could answer: " + "; ".join(failures), code="upstream_unavailable")

    def _payload(self, parsed: ParsedRequest, plan: RoutePlan) -> bytes:
        if self._forward_token_ids and parsed.prompt_text is not None:
            return orjson.dumps({**parsed.body, "prompt": plan.prompt_ids})
        return parsed.raw

    async def _attempt(
        self,
        request: web.Request,
        key: str,
        url: str,
        path: str,
        payload: bytes,
        headers: str,
        request_id: str,
        arrived: float,
    ) -> web.StreamResponse:
        try:
            upstream = await self._upstream.post(url, path, headers, payload)
        except _UPSTREAM_ERRORS as exc:
            raise _RetryableFailure(_describe(exc)) from None
        try:
            if upstream.status >= 500:
                raise _RetryableFailure(f"HTTP {upstream.status}: {await _excerpt(upstream)}")
            if upstream.status != 200 or upstream.media_type != "text/event-stream":
                # Whole answers (JSON, relayed 4xx) are small: read them completely, so a break
                # half-way is still retryable.
                body = await upstream.read()
                self._first_byte(key, arrived)
                response_headers = {"Content-Type": upstream.content_type or "application/json",
                                    REQUEST_ID_HEADER: request_id}
                if upstream.content_encoding:
                    response_headers["Content-Encoding"] = upstream.content_encoding
                return web.Response(status=upstream.status, body=body, headers=response_headers)
            return await self._relay_stream(request, upstream, key, request_id, arrived)
        except _UPSTREAM_ERRORS as exc:
            raise _RetryableFailure(_describe(exc)) from None
        finally:
            # Back to the pool only if the answer was read to its end; otherwise the connection is
            # closed, which also tells the engine to abort (client hang-up, failures).
            upstream.release()

    async def _relay_stream(
        self,
        request: web.Request,
        upstream: UpstreamResponse,
        key: str,
        request_id: str,
        arrived: float,
    ) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        pending = b""  # bytes of an event not yet complete
        while True:
            try:
                chunk = await upstream.read_chunk()
            except _UPSTREAM_ERRORS as exc:
                if response is None:
                    raise _RetryableFailure(_describe(exc)) from None
                await _end_with_error(response, f"the engine failed mid-stream: {_describe(exc)}")
                return response
            if not chunk:
                break
            if response is None:
                self._first_byte(key, arrived)
                response = web.StreamResponse(
                    headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                             REQUEST_ID_HEADER: request_id}
                )
                await response.prepare(request)
            pending += chunk
            cut = _events_end(pending)
            if cut:
                if not await _write(response, pending[:cut]):
                    return response
                pending = pending[cut:]
        if response is None:
            raise _RetryableFailure("the engine closed the stream without sending anything")
        if pending and not await _write(response, pending):
            return response
        await response.write_eof()
        return response

    def _first_byte(self, key: str, arrived: float) -> None:
        self._tracker.first_token(key)
        self._metrics.ttft_seconds.observe(time.perf_counter() - arrived)

    def _observe_hit_ratio(self, plan: RoutePlan, instance_id: str) -> None:
        score = plan.score(instance_id)
        if score is not None and plan.num_prompt_tokens:
            self._metrics.prefix_hit_ratio.observe(score.prefix_hit_tokens / plan.num_prompt_tokens)


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


async def _end_with_error(response: web.StreamResponse, message: str) -> None:
    event = b"data: " + orjson.dumps(error_payload(502, message, code="upstream_stream_error")) + b"\n\n"
    if await _write(response, event + _SSE_DONE):
        await response.write_eof()


async def _excerpt(upstream: UpstreamResponse, limit: int = 300) -> str:
    text = b""
    try:
        while len(text) < limit and (chunk := await upstream.read_chunk()):
            text += chunk
    except _UPSTREAM_ERRORS:
        pass
    return text[:limit].decode("utf-8", "replace") if text else "(no body)"


def _upstream_headers(request: web.Request, request_id: str) -> str:
    """The request's header lines for the engine: fixed ones, the request id and the passed ones."""
    lines = [_FIXED_HEADERS, _header_line(REQUEST_ID_HEADER, request_id)]
    for name in _PASSED_HEADERS:
        value = request.headers.get(name)
        if value is not None:
            lines.append(_header_line(name, value))
    return "".join(lines)


def _header_line(name: str, value: str) -> str:
    # aiohttp's parser never lets a line break into a value; checked anyway, as this text is sent raw.
    if "\r" in value or "\n" in value:
        raise APIError(400, f"invalid {name} header", param=name)
    return f"{name}: {value}\r\n"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return "timed out"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
