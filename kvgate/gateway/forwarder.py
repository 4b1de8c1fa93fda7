"""Send a planned request to an engine and relay the answer to the client as it arrives.

Rules, in the order a request meets them:
- Instances are tried in the decision's ranking, at most 1 + `forward_retries` of them, never the
  same one twice. A connection error, a 5xx or a broken answer *before the client has received a
  byte* moves on to the next; a 4xx is the client's problem and is relayed, never retried.
- The answer is relayed by `relay.py` (streams cut at event boundaries; after the first byte a
  failure ends the stream with an OpenAI-style error event and `data: [DONE]`).
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
from kvgate.gateway.auth import engine_authorization
from kvgate.gateway.errors import APIError
from kvgate.gateway.inflight import InflightTracker
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.registry import InstanceRegistry
from kvgate.gateway.relay import (
    REQUEST_ID_HEADER,
    UPSTREAM_ERRORS,
    RetryableFailure,
    describe,
    relay_answer,
)
from kvgate.gateway.request_notes import ANSWERED_BY
from kvgate.gateway.routing import RoutePlan
from kvgate.gateway.upstream import UpstreamPool, UpstreamResponse
from kvgate.metrics.definitions import GatewayMetrics

_FIXED_HEADERS = "Content-Type: application/json\r\nUser-Agent: kvgate\r\n"


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
        # The only client header an engine may need (its own API key); see gateway/auth.py.
        self._authorization = engine_authorization(settings)
        # Account keys are the gateway's own: clients may reuse an x-request-id concurrently.
        self._sequence = itertools.count()

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, plan: RoutePlan, request_id: str, arrived: float
    ) -> web.StreamResponse:
        path = "/v1/chat/completions" if parsed.chat else "/v1/completions"
        payload = self._payload(parsed, plan)
        headers = _upstream_headers(request_id, self._authorization(request))

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
            request[ANSWERED_BY] = instance_id
            try:
                response = await self._attempt(request, key, state.config.url, path, payload, headers, request_id,
                                               arrived)
            except RetryableFailure as failure:
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
        except UPSTREAM_ERRORS as exc:
            raise RetryableFailure(describe(exc)) from None
        try:
            if upstream.status >= 500:
                raise RetryableFailure(f"HTTP {upstream.status}: {await _excerpt(upstream)}")
            return await relay_answer(request, upstream, request_id, lambda: self._first_byte(key, arrived))
        except UPSTREAM_ERRORS as exc:
            raise RetryableFailure(describe(exc)) from None
        finally:
            # Back to the pool only if the answer was read to its end; otherwise the connection is
            # closed, which also tells the engine to abort (client hang-up, failures).
            upstream.release()

    def _first_byte(self, key: str, arrived: float) -> None:
        self._tracker.first_token(key)
        self._metrics.ttft_seconds.observe(time.perf_counter() - arrived)

    def _observe_hit_ratio(self, plan: RoutePlan, instance_id: str) -> None:
        score = plan.score(instance_id)
        if score is not None and plan.num_prompt_tokens:
            self._metrics.prefix_hit_ratio.observe(score.prefix_hit_tokens / plan.num_prompt_tokens)


async def _excerpt(upstream: UpstreamResponse, limit: int = 300) -> str:
    text = b""
    try:
        while len(text) < limit and (chunk := await upstream.read_chunk()):
            text += chunk
    except UPSTREAM_ERRORS:
        pass
    return text[:limit].decode("utf-8", "replace") if text else "(no body)"


def _upstream_headers(request_id: str, authorization: str | None) -> str:
    """The request's header lines for the engine: fixed ones, the request id and the authorization."""
    lines = [_FIXED_HEADERS, _header_line(REQUEST_ID_HEADER, request_id)]
    if authorization is not None:
        lines.append(_header_line("Authorization", authorization))
    return "".join(lines)


def _header_line(name: str, value: str) -> str:
    # aiohttp's parser never lets a line break into a value; checked anyway, as this text is sent raw.
    if "\r" in value or "\n" in value:
        raise APIError(400, f"invalid {name} header", param=name)
    return f"{name}: {value}\r\n"
