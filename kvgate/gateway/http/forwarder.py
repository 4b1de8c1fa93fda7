"""Send a planned request to an engine and relay the answer to the client as it arrives.

Rules, in the order a request meets them:
- Instances are tried in the decision's ranking, at most 1 + `forward_retries` of them, never the
  same one twice. Any failure to reach an instance, a 5xx, no first byte within
  `--upstream-first-byte-timeout-s` (streams; a whole answer comes only once generated, so it
  waits `--upstream-whole-answer-timeout-s`), the instance's ejection, or a broken answer *before
  the client has received a byte* moves on to the next; so does a 401/403 refusing credentials the
  gateway chose (auth.py). Other 4xx are the client's problem and are relayed, never retried. Every attempt's outcome feeds passive outlier detection (outliers.py).
- When every attempt failed the client gets a 502 naming its request id; what each engine said
  (its 5xx body may hold tracebacks) goes to the gateway log only.
- The answer is relayed by `relay.py` (streams cut at event boundaries; after the first byte a
  failure ends the stream with an OpenAI-style error event and `data: [DONE]`).
- A client that hangs up cancels the handler (aiohttp handler cancellation): the upstream
  connection is closed at once, which makes the engine abort the request.
- Each attempt owns one account entry, released on every exit path (finally).
- Each answer's usage report is compared with the prefix hit predicted at routing (hit_accounting.py);
  a stream whose client did not ask for usage asks the engine for it (usage.py).
- A plan with a prefill/decode decision goes to pd_forward.py instead (a pair per try).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web

from kvgate.config.settings import Settings
from kvgate.gateway.errors import APIError
from kvgate.gateway.feedback.dispatch import DispatchFeedback
from kvgate.gateway.feedback.prfaas import PrfaasLink
from kvgate.gateway.feedback.usage import UsageTap, stream_options_asking_usage
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.http.auth import engine_authorization, engine_refusal_is_the_gateways
from kvgate.gateway.http.handoff import make_handoff
from kvgate.gateway.http.pd_forward import PDForwarder
from kvgate.gateway.http.relay import (
    REQUEST_ID_HEADER,
    STREAM_BROKEN,
    UPSTREAM_ERRORS,
    RetryableFailure,
    describe,
    relay_answer,
    unavailable,
)
from kvgate.gateway.http.request_notes import ANSWERED_BY
from kvgate.gateway.http.upstream import UpstreamPool, UpstreamResponse
from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.tracing.names import FORWARD
from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.decode import DecodeLedger

if TYPE_CHECKING:
    from kvgate.gateway.tracing.spans import RequestTrace

log = logging.getLogger(__name__)

_FIXED_HEADERS = "Content-Type: application/json\r\nUser-Agent: kvgate\r\n"


class Forwarder:
    def __init__(
        self,
        upstream: UpstreamPool,
        settings: Settings,
        registry: InstanceRegistry,
        metrics: GatewayMetrics,
        feedback: DispatchFeedback,
        decode_ledger: DecodeLedger | None = None,
        prfaas: PrfaasLink | None = None,
    ) -> None:
        self._feedback = feedback
        self._upstream = upstream
        self._registry = registry
        self._tracker = feedback.tracker
        self._metrics = metrics
        self._outliers = feedback.outliers
        self._max_attempts = 1 + settings.forward_retries
        self._first_byte_timeout_s = settings.upstream_first_byte_timeout_s
        self._whole_answer_timeout_s = settings.upstream_whole_answer_timeout_s
        self._max_event_bytes = settings.max_sse_event_bytes
        self._forward_token_ids = settings.forward_token_ids
        # The only client header an engine may need (its own API key); see gateway/http/auth.py.
        self._authorization = engine_authorization(settings)
        self._refusal_is_the_gateways = engine_refusal_is_the_gateways(settings)
        # Account keys are the gateway's own: clients may reuse an x-request-id concurrently.
        self._sequence = itertools.count()
        # Only a gateway with a pd_protocol plans disaggregated requests (gateway/planning/routing.py).
        self._pd = PDForwarder(
            upstream, make_handoff(settings.pd_protocol), registry, feedback.tracker,
            decode_ledger if decode_ledger is not None else DecodeLedger(), metrics, feedback.outliers,
            self._max_attempts, self.relay_from, feedback.observe_hit_ratio, feedback.record_prefill_hit,
            feedback.ttft_dispatched, self.failed_status, prfaas,
        ) if settings.pd_protocol is not None else None

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, plan: RoutePlan, request_id: str, arrived: float,
        trace: RequestTrace | None = None,
    ) -> web.StreamResponse:
        headers = _upstream_headers(request_id, self._authorization(request))
        if plan.pd is not None and self._pd is not None:
            response = await self._pd.forward(request, parsed, plan, self._pd_body(parsed, plan), headers,
                                              request_id, arrived, trace)
            self._metrics.e2e_seconds.observe(time.perf_counter() - arrived)
            return response
        path = "/v1/chat/completions" if parsed.chat else "/v1/completions"
        compared = self._feedback.compares(parsed, plan)
        payload, usage_asked = self._payload(parsed, plan, compared)
        first_byte_timeout_s = self._first_byte_timeout_s if parsed.stream else self._whole_answer_timeout_s

        failures: list[str] = []
        last_failed: str | None = None
        attempts = 0
        for instance_id in plan.decision.ranking:
            if attempts == self._max_attempts:
                break
            state = self._registry.get(instance_id)
            # Skip instances removed, drained or ejected since the decision: a request sent to an
            # instance after its ejection failed over the requests waiting on it would wait alone.
            if state is None or not state.routable:
                continue
            attempts += 1
            if last_failed is not None:
                self._metrics.forward_retries.labels(last_failed).inc()
            key = f"{request_id}#{next(self._sequence)}"
            # Each prompt of a batch is prefilled: the first one's miss stands for each (routing.py).
            prompts = len(parsed.batch) if parsed.batch is not None else 1
            self._tracker.dispatch(key, instance_id, plan.miss_tokens(instance_id) * prompts)
            on_first_byte = self._feedback.ttft_dispatched(plan, instance_id, parsed.max_tokens)
            if attempts == 1:
                self._feedback.observe_hit_ratio(plan, instance_id)
            tap = UsageTap(strip_usage_chunk=usage_asked) if compared else None
            request[ANSWERED_BY] = instance_id
            try:
                if trace is None:
                    response = await self._attempt(request, key, state.config.url, path, payload, headers,
                                                   request_id, arrived, tap, first_byte_timeout_s, on_first_byte)
                else:
                    with trace.attempt(FORWARD, instance_id, state.config.url, attempts) as span:
                        response = await self._attempt(request, key, state.config.url, path, payload,
                                                       headers + span.header_lines(), request_id, arrived, tap,
                                                       first_byte_timeout_s, span.on_first_byte(on_first_byte))
                        span.answered(response.status, request.get(STREAM_BROKEN))
            except RetryableFailure as failure:
                failures.append(f"{instance_id}: {failure}")
                self._outliers.failure(instance_id, str(failure))
                last_failed = instance_id
                continue
            finally:
                self._tracker.release(key)
            broken = request.get(STREAM_BROKEN)
            if broken is None:
                self._outliers.success(instance_id)
            else:
                self._outliers.failure(instance_id, f"stream broken: {broken}")
            self._metrics.e2e_seconds.observe(time.perf_counter() - arrived)
            if tap is not None:
                self._feedback.record_hit(plan, instance_id, tap, request_id)
            return response
        if not failures:
            raise APIError(503, f"no healthy instance serves '{parsed.model}'", code="no_healthy_instance")
        raise unavailable(request_id, failures)

    def failed_status(self, status: int, url: str) -> bool:
        """An answer that is the instance's failure (retried elsewhere, counted for ejection): a 5xx, or
        a 401/403 refusing credentials the gateway chose. Other 4xx are the client's, relayed."""
        return status >= 500 or status in (401, 403) and self._refusal_is_the_gateways(url)

    def _payload(self, parsed: ParsedRequest, plan: RoutePlan, compared: bool) -> tuple[bytes, bool]:
        """The body for the engine, and whether it asks for usage the client did not ask for."""
        changes: dict = {}
        if self._forward_token_ids and parsed.prompt_text is not None and parsed.batch is None:
            changes["prompt"] = plan.prompt_ids
        options = stream_options_asking_usage(parsed) if compared else None
        if options is not None:
            changes["stream_options"] = options
        if not changes:
            return parsed.raw, False
        return orjson.dumps({**parsed.body, **changes}), options is not None

    def _pd_body(self, parsed: ParsedRequest, plan: RoutePlan) -> dict[str, Any]:
        """The client's body as the hand-off starts from (token ids with --forward-token-ids)."""
        if self._forward_token_ids and parsed.prompt_text is not None and parsed.batch is None:
            return {**parsed.body, "prompt": plan.prompt_ids}
        return parsed.body

    async def relay_from(
        self,
        request: web.Request,
        key: str,
        url: str,
        path: str,
        payload: bytes,
        headers: str,
        request_id: str,
        arrived: float,
        on_first_byte: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        """A decode instance's answer relayed to the client (the PD path); `key`'s account entry sees
        its first byte. No first-byte timeout: that byte waits for the prefill and the KV transfer."""
        return await self._attempt(request, key, url, path, payload, headers, request_id, arrived, None, None,
                                   on_first_byte)

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
        tap: UsageTap | None,
        first_byte_timeout_s: float | None,
        on_first_byte: Callable[[], None] | None = None,
    ) -> web.StreamResponse:
        try:
            upstream = await self._upstream.post(url, path, headers, payload, first_byte_timeout_s)
        except UPSTREAM_ERRORS as exc:
            raise RetryableFailure(describe(exc)) from None
        try:
            if self.failed_status(upstream.status, url):
                raise RetryableFailure(f"HTTP {upstream.status}: {await _excerpt(upstream)}")
            return await relay_answer(request, upstream, request_id,
                                      lambda: self._feedback.first_byte(key, arrived, on_first_byte), tap,
                                      self._max_event_bytes)
        except UPSTREAM_ERRORS as exc:
            raise RetryableFailure(describe(exc)) from None
        finally:
            # Back to the pool only if the answer was read to its end; otherwise the connection is
            # closed, which also tells the engine to abort (client hang-up, failures).
            upstream.release()

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
