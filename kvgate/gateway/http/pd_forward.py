"""Forward a disaggregated request: a prefill and a decode instance per try (docs/PD.md).

Rules, in the order a request meets them:
- Pairs are tried at most 1 + `forward_retries` times. A try that fails before the client received
  a byte moves on: the side that failed (prefill, decode or both) takes its next instance in its own
  ranking, the other keeps its instance; every try gets fresh hand-off identifiers (room, transfer id).
- The hand-off (gateway/http/handoff/) says whether the two bodies go out at once (SGLang) or the decode
  body is built from the prefill's answer (vLLM). The client's answer is always the decode
  instance's, relayed by relay.py like a whole request's; a 4xx from either side is relayed as is.
- Skip-prefill: the request goes to the decode instance alone, which computes the prompt itself.
- Prefill-as-a-Service: the plan's cluster decision chose the prefill instances' cluster; the
  KV a pair puts on the PrfaaS link is recorded at the decode instance's first byte (gateway/feedback/prfaas.py).
- Account: the prefill instance holds the prompt's uncached tokens until its answer is read; the
  decode instance holds one request (and its predicted decode tokens in the DecodeLedger) until its
  stream ends. Every entry is released in a `finally`, so a client hang-up (handler cancellation)
  cancels both upstream requests and leaves nothing behind.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import orjson
from aiohttp import web

from kvgate.gateway.errors import APIError
from kvgate.gateway.feedback.prfaas import PrfaasLink
from kvgate.gateway.fleet.inflight import InflightTracker
from kvgate.gateway.fleet.outliers import OutlierDetector
from kvgate.gateway.fleet.registry import InstanceRegistry, InstanceState
from kvgate.gateway.http.handoff import HandOff, HandOffError
from kvgate.gateway.http.relay import (
    REQUEST_ID_HEADER,
    STREAM_BROKEN,
    UPSTREAM_ERRORS,
    RetryableFailure,
    describe,
    unavailable,
)
from kvgate.gateway.http.request_notes import ANSWERED_BY, PREFILLED_BY
from kvgate.gateway.http.upstream import UpstreamPool
from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.tracing.names import DECODE, PREFILL
from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.decode import DecodeLedger

if TYPE_CHECKING:
    from kvgate.gateway.tracing.spans import RequestTrace

Side = Literal["prefill", "decode", "both"]
# A traced try: the request's trace and the try's number (1 for the first).
Traced = tuple["RequestTrace", int]
# OpenAI's default max_tokens, counted for a request that names none.
DEFAULT_MAX_TOKENS = 16
RelayFrom = Callable[..., Awaitable[web.StreamResponse]]
# (parsed, plan, prefill instance id, its JSON answer, request id): the prefill instance's usage
# reports the cached tokens it found, which the hit accounting compares with the prediction.
RecordPrefillHit = Callable[[ParsedRequest, RoutePlan, str, bytes, str], None]
# (plan, prefill instance id, max_tokens) -> what to call when its prefill is done: the TTFT model
# predicted that instance's queue + prefill + transfer, so its answer's arrival calibrates it.
TTFTDispatched = Callable[[RoutePlan, str, int | None], Callable[[], None]]


class PairFailure(Exception):
    def __init__(self, side: Side, message: str) -> None:
        super().__init__(message)
        self.side = side


@dataclass(frozen=True, slots=True)
class _PrefillAnswer:
    status: int
    body: bytes
    content_type: str


class PDForwarder:
    def __init__(
        self,
        upstream: UpstreamPool,
        handoff: HandOff,
        registry: InstanceRegistry,
        tracker: InflightTracker,
        ledger: DecodeLedger,
        metrics: GatewayMetrics,
        outliers: OutlierDetector,
        max_attempts: int,
        relay_decode: RelayFrom,
        observe_hit_ratio: Callable[[RoutePlan, str], None],
        record_prefill_hit: RecordPrefillHit,
        ttft_dispatched: TTFTDispatched,
        failed_status: Callable[[int, str], bool],
        prfaas: PrfaasLink | None = None,
    ) -> None:
        self._upstream = upstream
        self._handoff = handoff
        self._registry = registry
        self._tracker = tracker
        self._ledger = ledger
        self._metrics = metrics
        self._outliers = outliers
        self._max_attempts = max_attempts
        # The forwarder's relay of one instance's answer (post, 5xx check, relay.py, first byte).
        self._relay_decode = relay_decode
        self._observe_hit_ratio = observe_hit_ratio
        self._record_prefill_hit = record_prefill_hit
        self._ttft_dispatched = ttft_dispatched
        # Whether an answer's status is the instance's failure (the forwarder's rule).
        self._failed_status = failed_status
        self._prfaas = prfaas
        self._sequence = itertools.count()

    async def forward(
        self, request: web.Request, parsed: ParsedRequest, plan: RoutePlan, body: dict[str, Any],
        headers: str, request_id: str, arrived: float, trace: RequestTrace | None = None,
    ) -> web.StreamResponse:
        pd = plan.pd
        assert pd is not None
        if parsed.batch is not None or body.get("n") not in (None, 1):
            # One hand-off carries one prompt's KV (one room, one transfer id) to one sequence.
            raise APIError(400, f"'{parsed.model}' is served disaggregated (prefill/decode): send one prompt "
                           "per request and n=1", param="n" if parsed.batch is None else "prompt")
        path = "/v1/chat/completions" if parsed.chat else "/v1/completions"
        prefills = _routable(self._registry, pd.prefill.ranking)
        decodes = _routable(self._registry, pd.decode.ranking)
        prefill = None if pd.skip_prefill else next(prefills, None)
        decode = next(decodes, None)
        max_tokens = _max_tokens(body)
        if self._prfaas is not None and pd.cluster is not None:
            self._prfaas.dispatched(pd.cluster)
        failures: list[str] = []
        last_failed = ""
        for attempt in range(self._max_attempts):
            if decode is None or (prefill is None and not pd.skip_prefill):
                break
            if attempt:
                self._metrics.forward_retries.labels(last_failed).inc()
            else:  # the hit the policy found for the instance that computes the prompt
                self._observe_hit_ratio(plan, prefill.id if prefill is not None else decode.id)
            key = f"{request_id}#pd{next(self._sequence)}"
            request[ANSWERED_BY] = decode.id
            if prefill is not None:
                request[PREFILLED_BY] = prefill.id
            decode_key = key + "/decode"
            decode_tokens = pd.decode_miss_tokens if prefill is None else 0
            self._tracker.dispatch(decode_key, decode.id, decode_tokens)
            self._ledger.add(decode_key, decode.id, max_tokens)
            try:
                traced = (trace, attempt + 1) if trace is not None else None
                if prefill is None:
                    payload = orjson.dumps(self._handoff.local_body(body))
                    return await self._decode_only(request, decode_key, decode, path, payload, headers,
                                                   request_id, arrived, traced=traced)
                return await self._pair(request, key, parsed, plan, prefill, decode, path, body, headers,
                                        request_id, arrived, traced)
            except PairFailure as failure:
                last_failed = prefill.id if failure.side == "prefill" and prefill else decode.id
                failures.append(f"{last_failed}: {failure}")
                # Passive outlier detection sees the instance that failed (gateway/fleet/outliers.py).
                self._outliers.failure(last_failed, str(failure))
                if failure.side in ("prefill", "both") and prefill is not None:
                    self._handoff.forget(prefill.config)
                    prefill = next(prefills, None)
                if failure.side in ("decode", "both"):
                    decode = next(decodes, None)
            finally:
                self._tracker.release(decode_key)
                self._ledger.release(decode_key)
        if not failures:
            raise APIError(503, f"no healthy prefill and decode instance serves '{parsed.model}'",
                           code="no_healthy_instance")
        raise unavailable(request_id, failures, "prefill/decode pair")

    async def _decode_only(self, request: web.Request, key: str, decode: InstanceState, path: str,
                           payload: bytes, headers: str, request_id: str, arrived: float,
                           on_first_byte: Callable[[], None] | None = None,
                           traced: Traced | None = None) -> web.StreamResponse:
        try:
            return await self._relay(request, key, decode, path, payload, headers, request_id, arrived,
                                     on_first_byte, traced)
        except RetryableFailure as failure:
            raise PairFailure("decode", str(failure)) from None

    async def _relay(self, request: web.Request, key: str, decode: InstanceState, path: str, payload: bytes,
                     headers: str, request_id: str, arrived: float, on_first_byte: Callable[[], None] | None,
                     traced: Traced | None) -> web.StreamResponse:
        """The decode instance's answer relayed to the client; traced, under a `kvgate.decode` span
        whose traceparent the decode instance receives."""
        url = decode.config.url
        if traced is None:
            return await self._relay_decode(request, key, url, path, payload, headers, request_id, arrived,
                                            on_first_byte=on_first_byte)
        trace, attempt = traced
        with trace.attempt(DECODE, decode.id, url, attempt) as span:
            response = await self._relay_decode(request, key, url, path, payload, headers + span.header_lines(),
                                                request_id, arrived, on_first_byte=span.on_first_byte(on_first_byte))
            span.answered(response.status, request.get(STREAM_BROKEN))
            return response

    async def _pair(
        self, request: web.Request, key: str, parsed: ParsedRequest, plan: RoutePlan, prefill: InstanceState,
        decode: InstanceState, path: str, body: dict[str, Any], headers: str, request_id: str, arrived: float,
        traced: Traced | None,
    ) -> web.StreamResponse:
        try:
            exchange = await self._handoff.attempt(body, prefill.config, request_id)
        except HandOffError as exc:
            raise PairFailure("prefill", str(exc)) from None
        prefill_key = key + "/prefill"
        self._tracker.dispatch(prefill_key, prefill.id, plan.miss_tokens(prefill.id))
        prefill_task = asyncio.create_task(
            self._prefill(prefill_key, prefill, path, orjson.dumps(exchange.prefill_body), headers,
                          self._ttft_dispatched(plan, prefill.id, parsed.max_tokens), traced))
        decode_key = key + "/decode"
        cluster, prfaas = plan.pd.cluster if plan.pd is not None else None, self._prfaas

        def kv_arrived() -> None:
            if prfaas is not None and cluster is not None:
                prfaas.kv_crossed(cluster)

        try:
            if not self._handoff.concurrent:
                answer = await prefill_task
                if answer.status != 200:
                    return _as_response(answer, request_id)
                self._record_prefill_hit(parsed, plan, prefill.id, answer.body, request_id)
                try:
                    decode_body = exchange.decode_body(orjson.loads(answer.body))
                except (HandOffError, orjson.JSONDecodeError, AttributeError) as exc:
                    self._metrics.engine_values_refused.labels("kv_transfer_params").inc()
                    raise PairFailure("prefill", f"unusable prefill answer: {exc}") from None
                return await self._decode_only(request, decode_key, decode, path, orjson.dumps(decode_body),
                                               headers, request_id, arrived, kv_arrived, traced)
            response = await self._concurrent(request, prefill_task, decode_key, decode, path,
                                              orjson.dumps(exchange.decode_body(None)), headers, request_id, arrived,
                                              kv_arrived, traced)
            answer = _prefill_answer(prefill_task)
            if answer is not None and answer.status == 200 and answer.content_type.startswith("application/json"):
                self._record_prefill_hit(parsed, plan, prefill.id, answer.body, request_id)
            return response
        finally:
            prefill_task.cancel()
            await asyncio.gather(prefill_task, return_exceptions=True)
            self._tracker.release(prefill_key)

    async def _concurrent(
        self, request: web.Request, prefill_task: asyncio.Task[_PrefillAnswer], decode_key: str,
        decode: InstanceState, path: str, payload: bytes, headers: str, request_id: str, arrived: float,
        on_first_byte: Callable[[], None], traced: Traced | None,
    ) -> web.StreamResponse:
        """Both sent at once: a prefill failure before the decode's first byte fails the pair (the
        decode would wait for KV that never comes); after it, the decode's answer stands."""
        started = asyncio.Event()

        def first_byte() -> None:
            started.set()
            on_first_byte()

        decode_task = asyncio.create_task(
            self._relay(request, decode_key, decode, path, payload, headers, request_id, arrived, first_byte, traced))
        try:
            await asyncio.wait({prefill_task, decode_task}, return_when=asyncio.FIRST_COMPLETED)
            if not decode_task.done() and not started.is_set():
                failure = _prefill_failure(prefill_task)
                if failure is not None:
                    raise failure
                if prefill_task.result().status != 200:
                    return _as_response(prefill_task.result(), request_id)
            try:
                return await decode_task
            except RetryableFailure as exc:
                side: Side = "both" if _prefill_failure(prefill_task) is not None else "decode"
                raise PairFailure(side, str(exc)) from None
        finally:
            decode_task.cancel()
            await asyncio.gather(decode_task, return_exceptions=True)

    async def _prefill(self, key: str, prefill: InstanceState, path: str, payload: bytes, headers: str,
                       prefill_done: Callable[[], None], traced: Traced | None) -> _PrefillAnswer:
        """The prefill instance's whole answer; traced, under a `kvgate.prefill` span whose traceparent
        the prefill instance receives (its first-byte event: the answer is in, the prefill done)."""
        if traced is None:
            return await self._prefill_answer(key, prefill, path, payload, headers, prefill_done)
        trace, attempt = traced
        with trace.attempt(PREFILL, prefill.id, prefill.config.url, attempt) as span:
            answer = await self._prefill_answer(key, prefill, path, payload, headers + span.header_lines(),
                                                span.on_first_byte(prefill_done))
            span.answered(answer.status)
            return answer

    async def _prefill_answer(self, key: str, prefill: InstanceState, path: str, payload: bytes,
                              headers: str, prefill_done: Callable[[], None]) -> _PrefillAnswer:
        """The prefill instance's whole answer; its part is done (account released) once read."""
        try:
            upstream = await self._upstream.post(prefill.config.url, path, headers, payload)
        except UPSTREAM_ERRORS as exc:
            raise PairFailure("prefill", describe(exc)) from None
        try:
            body = await upstream.read()
            if self._failed_status(upstream.status, prefill.config.url):
                raise PairFailure("prefill", f"HTTP {upstream.status}: {body[:300].decode('utf-8', 'replace')}")
            if upstream.status == 200:
                prefill_done()
            return _PrefillAnswer(upstream.status, body, upstream.content_type or "application/json")
        except UPSTREAM_ERRORS as exc:
            raise PairFailure("prefill", describe(exc)) from None
        finally:
            upstream.release()
            self._tracker.release(key)


def _prefill_answer(task: asyncio.Task[_PrefillAnswer]) -> _PrefillAnswer | None:
    if task.done() and not task.cancelled() and task.exception() is None:
        return task.result()
    return None


def _prefill_failure(task: asyncio.Task[_PrefillAnswer]) -> PairFailure | None:
    if not task.done() or task.cancelled():
        return None
    exc = task.exception()
    if exc is None:
        return None
    if isinstance(exc, PairFailure):
        return exc
    raise exc


def _as_response(answer: _PrefillAnswer, request_id: str) -> web.Response:
    """A prefill instance's 4xx is the client's problem: relayed as is, never retried."""
    return web.Response(status=answer.status, body=answer.body,
                        headers={"Content-Type": answer.content_type, REQUEST_ID_HEADER: request_id})


def _routable(registry: InstanceRegistry, ranking: tuple[str, ...]) -> Iterator[InstanceState]:
    """Instances in ranking order, skipping those removed, drained or ejected since the decision."""
    for instance_id in ranking:
        state = registry.get(instance_id)
        if state is not None and state.routable:
            yield state


def _max_tokens(body: dict[str, Any]) -> int:
    for field in ("max_completion_tokens", "max_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return DEFAULT_MAX_TOKENS

