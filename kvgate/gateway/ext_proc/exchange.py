"""One request's way through the endpoint picker, from Envoy's first message to the answer's end.

Request path: the body is buffered to its end (or to the request's trailers), parsed with the HTTP
front door's own parsers and planned by the shared core (`plan_admitted`: tokenize, hash, store or
events lookup, policy, early rejection). The answer to the headers names the pick (an engine's
`IP:PORT`) in `x-gateway-destination-endpoint`, and the pick then up to `forward_retries` fallbacks in
ranking order in the `envoy.lb` metadata (messages.py says why); the body follows unchanged.
If Envoy sent a subset hint, only its endpoints are picked. A refusal is an immediate answer in
OpenAI JSON: 400 (bad body), 404 (unknown model or route), 413, 429 (early rejection, Retry-After),
503 (no routable engine, or none in the subset).

Response path: the answer is passed back unchanged while the core learns from it as it would from
the forwarder: the dispatch is in the load account from the pick on, the first byte (a stream's first
chunk, a whole answer's end) feeds the account and the TTFT model, the usage in the answer feeds hit
accounting, a 5xx counts for outlier ejection. The account entry is released when the answer ends,
and by `close()` on every other end (a client reset, an upstream failure: the gRPC stream ends first).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from envoy.service.ext_proc.v3.external_processor_pb2 import ProcessingRequest, ProcessingResponse
from yarl import URL

from kvgate.gateway.core import plan_admitted
from kvgate.gateway.errors import APIError, error_payload
from kvgate.gateway.ext_proc import messages
from kvgate.gateway.feedback.usage import UsageTap, events_end, stream_options_asking_usage
from kvgate.gateway.operations.observe import CLIENT_CLOSED, REQUEST_ID_HEADER, client_request_id
from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import ParsedRequest, parse_chat, parse_completion
from kvgate.gateway.state import Gateway
from kvgate.gateway.tracing import names

if TYPE_CHECKING:
    from kvgate.gateway.tracing.spans import AttemptSpan, RequestTrace

log = logging.getLogger(__name__)

PARSERS: dict[str, Callable[[bytes], ParsedRequest]] = {
    "/v1/completions": parse_completion,
    "/v1/chat/completions": parse_chat,
}
_UNMATCHED = "unmatched"


def endpoint_address(url: str) -> str:
    """An engine's `IP:PORT` as Envoy's original-destination cluster reads it (`[v6]:port` for IPv6)."""
    parsed = URL(url)
    host = parsed.raw_host or ""
    return f"[{host}]:{parsed.port}" if ":" in host else f"{host}:{parsed.port}"


class Exchange:
    def __init__(self, gateway: Gateway, request_id: Callable[[], str], account_key: Callable[[str], str]) -> None:
        self._gateway = gateway
        self._new_request_id = request_id
        self._account_key = account_key
        self._arrived = time.perf_counter()
        self.request_id = ""
        self._route = _UNMATCHED
        self._subset: frozenset[str] | None = None
        self._body = bytearray()
        self._decided = False
        # Set once a request went to an engine: its account entry and what its answer is compared with.
        self._key: str | None = None
        self._instance_id = ""
        self._plan: RoutePlan | None = None
        self._on_first_byte: Callable[[], None] | None = None
        self._tap: UsageTap | None = None
        # The answer as it comes back.
        self._status = 0
        self._stream = False
        self._first_byte_seen = False
        self._pending = bytearray()  # an SSE answer's bytes after its last complete event
        self._whole = bytearray()  # a whole answer, while it is read for its usage
        self._finished = False
        # Traced requests only (gateway/tracing/): the server span, and the span of the pick Envoy sends.
        self._trace: RequestTrace | None = None
        self._span: AttemptSpan | None = None

    async def handle(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        """Envoy's message in, the picker's answers out (none while the request body is buffered)."""
        kind = message.WhichOneof("request")
        if kind == "request_headers":
            return await self._request_headers(message)
        if kind == "request_body":
            body = message.request_body
            self._body += body.body
            if len(self._body) > self._gateway.settings.max_body_bytes:
                return [self._refuse(APIError(413, "request body too large: the limit is "
                                                   f"{self._gateway.settings.max_body_bytes} bytes",
                                              code="body_too_large"))]
            return await self._decide(end_of_stream=True) if body.end_of_stream else []
        if kind == "request_trailers":
            answers = [] if self._decided else await self._decide(end_of_stream=False)
            if not self._finished:
                answers.append(messages.request_trailers_unchanged())
            return answers
        if kind == "response_headers":
            return self._response_headers(message)
        if kind == "response_body":
            return [self._response_body(message.response_body.body, message.response_body.end_of_stream)]
        if kind == "response_trailers":
            self._finish()
            return [messages.response_trailers_unchanged()]
        return []

    def close(self) -> None:
        """The stream ended before the answer did (a client reset, an upstream cut, Envoy's own end):
        release the account entry; counted as 499 as the HTTP front door counts a hang-up."""
        self._end(CLIENT_CLOSED)

    def _end(self, status: str, code: str | None = None) -> None:
        """Release the account entry (once) and count the request by route and status."""
        if self._finished:
            return
        self._finished = True
        if self._key is not None:
            self._gateway.feedback.tracker.release(self._key)
        self._gateway.metrics.requests.labels(self._route, status).inc()
        if self._trace is not None:
            self._end_trace(status, code)

    def _end_trace(self, status: str, code: str | None) -> None:
        assert self._trace is not None
        if status == CLIENT_CLOSED:
            if self._span is not None:
                self._span.cancelled()
            self._trace.closed()
            return
        if self._span is not None:
            self._span.answered(self._status)
            self._span.end()
        if code is not None:
            self._trace.failed(self._status, code)
        else:
            self._trace.answered(self._status)

    async def _request_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers = messages.header_values(message.request_headers.headers)
        self.request_id = client_request_id(headers.get("x-request-id")) or self._new_request_id()
        path = headers.get(":path", "").partition("?")[0]
        self._route = path if path in PARSERS else _UNMATCHED
        self._subset = messages.subset_hint(message)
        tracing = self._gateway.tracing
        if tracing is not None:
            from kvgate.gateway.tracing.spans import RequestTrace

            self._trace = RequestTrace(tracing, headers.get(":method", "POST"), self._route, path, headers,
                                       self._arrived, {names.REQUEST_ID: self.request_id, names.FRONT_DOOR: "epp"})
        if message.request_headers.end_of_stream:  # no body: nothing to route on
            return await self._decide(end_of_stream=True)
        return []

    async def _decide(self, end_of_stream: bool) -> list[ProcessingResponse]:
        """The pick for the buffered body, then the body itself; or the refusal."""
        self._decided = True
        parse = PARSERS.get(self._route)
        try:
            if parse is None:
                raise APIError(404, "the endpoint picker routes POST /v1/completions and /v1/chat/completions",
                               code="route_not_found")
            parsed = parse(bytes(self._body))
            if self._trace is not None:
                self._trace.parsed(parsed)
            plan = await plan_admitted(self._gateway, parsed, self._trace)
            picks = self._picks(plan, parsed.model)
        except APIError as exc:
            return [self._refuse(exc)]
        except Exception:
            log.exception("endpoint picker: request %s failed", self.request_id)
            return [self._refuse(APIError(500, "internal gateway error; see the gateway log", code="internal_error"))]
        self._dispatch(parsed, plan, picks[0][0])
        trace_context: dict[str, str] = {}
        if self._trace is not None:  # Envoy sends the request to the engine under this span
            state = self._gateway.registry.get(picks[0][0])
            self._span = self._trace.attempt(names.FORWARD, picks[0][0], state.config.url if state else "", 1)
            trace_context = self._span.headers()
        destination = messages.destination([address for _, address in picks], trace_context)
        return [destination, *messages.request_body_chunks(bytes(self._body), end_of_stream)]

    def _picks(self, plan: RoutePlan, model: str) -> list[tuple[str, str]]:
        """(instance id, address) in ranking order: the pick, then up to --forward-retries fallbacks,
        each routable now and, when Envoy sent a subset hint, in it."""
        if plan.pd is not None:
            raise APIError(503, "the endpoint picker does not serve prefill/decode disaggregation",
                           code="no_healthy_instance")
        registry = self._gateway.registry
        limit = 1 + self._gateway.settings.forward_retries
        picks: list[tuple[str, str]] = []
        for instance_id in plan.decision.ranking:
            state = registry.get(instance_id)
            if state is None or not state.routable:
                continue
            address = endpoint_address(state.config.url)
            if self._subset is not None and address not in self._subset:
                continue
            picks.append((instance_id, address))
            if len(picks) == limit:
                break
        if not picks:
            where = " among the endpoints Envoy allowed (subset hint)" if self._subset is not None else ""
            raise APIError(503, f"no healthy instance serves '{model}'{where}", code="no_healthy_instance")
        return picks

    def _dispatch(self, parsed: ParsedRequest, plan: RoutePlan, instance_id: str) -> None:
        """The request leaves for `instance_id`: in the account and the TTFT model from now on."""
        feedback = self._gateway.feedback
        self._key = self._account_key(self.request_id)
        self._instance_id = instance_id
        self._plan = plan
        # Each prompt of a batch is prefilled: the first one's miss stands for each (routing.py).
        prompts = len(parsed.batch) if parsed.batch is not None else 1
        feedback.tracker.dispatch(self._key, instance_id, plan.miss_tokens(instance_id) * prompts)
        self._on_first_byte = feedback.ttft_dispatched(plan, instance_id, parsed.max_tokens)
        feedback.observe_hit_ratio(plan, instance_id)
        # The answer passes unchanged, so a stream reports usage only if its client asked for it.
        if feedback.compares(parsed, plan) and stream_options_asking_usage(parsed) is None:
            self._tap = UsageTap(strip_usage_chunk=False)

    def _refuse(self, error: APIError) -> ProcessingResponse:
        self._status = error.status
        self._end(str(error.status), error.code or "")
        body = orjson.dumps(error_payload(error.status, error.message, error.param, error.code))
        return messages.immediate(error.status, body, {**(error.headers or {}), REQUEST_ID_HEADER: self.request_id})

    def _response_headers(self, message: ProcessingRequest) -> list[ProcessingResponse]:
        headers = messages.header_values(message.response_headers.headers)
        try:
            self._status = int(headers.get(":status", "0"))
        except ValueError:
            self._status = 0
        self._stream = headers.get("content-type", "").partition(";")[0].strip().lower() == "text/event-stream"
        if self._tap is not None and (self._status != 200 or headers.get("content-encoding")):
            self._tap = None  # no usage to read: an error, or bytes the picker cannot read
        if self._key is not None and self._status >= 500:
            self._gateway.feedback.outliers.failure(self._instance_id, f"HTTP {self._status}")
        if message.response_headers.end_of_stream:
            self._first_byte()
            self._finish()
        return [messages.response_headers_unchanged()]

    def _response_body(self, chunk: bytes, end_of_stream: bool) -> ProcessingResponse:
        if self._stream and chunk:
            self._first_byte()
        if self._tap is not None:
            self._read_usage(chunk, end_of_stream)
        if end_of_stream:
            self._first_byte()  # a whole answer's first byte is its end, as the forwarder reads it
            self._finish()
        return messages.response_body_chunk(chunk, end_of_stream)

    def _read_usage(self, chunk: bytes, end_of_stream: bool) -> None:
        """Feed the usage tap: complete SSE events as they come, a whole answer at its end."""
        assert self._tap is not None
        limit = self._gateway.settings.max_sse_event_bytes if self._stream else self._gateway.settings.max_body_bytes
        buffer = self._pending if self._stream else self._whole
        buffer += chunk
        if self._stream:
            cut = events_end(buffer)
            if cut:
                self._tap.events(bytes(buffer[:cut]))
                del buffer[:cut]
            if end_of_stream:
                self._tap.end(bytes(buffer))
        elif end_of_stream:
            self._tap.whole(bytes(buffer))
        if len(buffer) > limit:  # not an answer the forwarder would read either: stop reading
            self._tap = None

    def _first_byte(self) -> None:
        if self._first_byte_seen or self._key is None:
            return
        self._first_byte_seen = True
        self._gateway.feedback.first_byte(self._key, self._arrived, self._on_first_byte)
        if self._span is not None:
            self._span.first_byte()

    def _finish(self) -> None:
        """The answer ended normally (its last body chunk or its trailers)."""
        if self._finished:
            return
        if self._key is not None and self._status < 500:
            feedback = self._gateway.feedback
            feedback.outliers.success(self._instance_id)
            self._gateway.metrics.e2e_seconds.observe(time.perf_counter() - self._arrived)
            if self._tap is not None and self._plan is not None:
                feedback.record_hit(self._plan, self._instance_id, self._tap, self.request_id)
        self._end(str(self._status))
