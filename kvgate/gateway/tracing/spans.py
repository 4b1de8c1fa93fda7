"""One request's spans, and every span and attribute name kvgate writes (docs/OPERATIONS.md, "Tracing").

A request is one server span, continuing the client's W3C traceparent when it sent one. Its children:
the planner's stages (`kvgate.tokenize`, `kvgate.lookup`, `kvgate.schedule`), written once the plan
is made from the times the planner took (routing.py's `RoutePlan.stages`), so planning itself carries
no tracing code; then one client span per attempt sent to an engine (`kvgate.forward`, or for a
disaggregated request `kvgate.prefill` and `kvgate.decode`), whose traceparent the engine receives, so
the engine's own spans join the trace. Every name is in names.py.

Spans are started with an explicit parent context and never made current: nothing depends on
contextvars crossing the event loop's tasks.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from yarl import URL

from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.tracing import names
from kvgate.gateway.tracing.provider import Tracing

_PROPAGATOR = TraceContextTextMapPropagator()


class RequestTrace:
    """The spans of one request, from its arrival (`arrived`, time.perf_counter()) to its answer's end.
    As a context manager it ends the server span, with the status of an APIError or cancellation
    that leaves it (`answered` states the status of an answer that was sent)."""

    def __init__(self, tracing: Tracing, method: str, route: str, path: str, headers: Mapping[str, str],
                 arrived: float, attributes: dict[str, Any]) -> None:
        self._tracing = tracing
        # Spans' times are the epoch's nanoseconds; the planner's and the doors' are perf_counter's.
        self._epoch_ns = time.time_ns() - int(arrived * 1e9)
        parent = _PROPAGATOR.extract(headers)
        self.span = tracing.tracer.start_span(
            f"{method} {route}", context=parent, kind=SpanKind.SERVER, start_time=self._ns(arrived),
            attributes={names.HTTP_METHOD: method, names.HTTP_ROUTE: route, names.URL_PATH: path,
                        **attributes})
        self._context = trace.set_span_in_context(self.span)
        self._ended = False

    def _ns(self, perf: float) -> int:
        return self._epoch_ns + int(perf * 1e9)

    def parsed(self, parsed: ParsedRequest) -> None:
        attributes: dict[str, Any] = {names.GEN_AI_OPERATION: "chat" if parsed.chat else "text_completion",
                                      names.GEN_AI_MODEL: parsed.model, names.STREAM: parsed.stream}
        if parsed.max_tokens is not None:
            attributes[names.GEN_AI_MAX_TOKENS] = parsed.max_tokens
        self.span.set_attributes(attributes)

    def planned(self, plan: RoutePlan) -> None:
        """The planner's stages as child spans, and its decision on the server span."""
        if not self.span.is_recording():
            return
        started, tokenized, looked_up, decided = plan.stages
        prompt = {names.PROMPT_TOKENS: plan.num_prompt_tokens,
                  names.PROMPT_TOKENS_ESTIMATED: plan.prompt_tokens_estimated}
        self._stage(names.TOKENIZE, started, tokenized, prompt)
        events = "off" if not self._tracing.events_on else "ok" if plan.engine_hits is not None else "skipped"
        lookup = {names.KVS_STATUS: plan.kvs_status, names.KVS_ELAPSED: plan.kvs_elapsed_s,
                  names.EVENTS_STATUS: events, names.BLOCKS: len(plan.block_keys)}
        self._stage(names.LOOKUP, tokenized, looked_up, lookup)
        decision = self._decision(plan)
        self._stage(names.SCHEDULE, looked_up, decided, decision)
        self.span.set_attributes({**prompt, **lookup, **decision})

    def _decision(self, plan: RoutePlan) -> dict[str, Any]:
        selected = plan.decision.selected
        attributes: dict[str, Any] = {names.POLICY: self._tracing.policy, names.CANDIDATES: len(plan.candidates),
                                      names.CACHE_AWARE: plan.decision.cache_aware,
                                      names.RANKING: list(plan.decision.ranking[:names.RANKING_SHOWN])}
        if plan.pd is not None:
            attributes[names.PD_DECODE_INSTANCE] = plan.pd.decode.selected or ""
            attributes[names.PD_SKIP_PREFILL] = plan.pd.skip_prefill
            if plan.pd.cluster is not None:
                attributes[names.PD_CLUSTER] = plan.pd.cluster.cluster
        if selected is None:
            return attributes
        attributes[names.INSTANCE] = selected
        score = plan.score(selected)
        if score is not None:
            attributes[names.PREFIX_HIT_TOKENS] = score.prefix_hit_tokens
        prediction = plan.prediction(selected)
        if prediction is not None:
            attributes.update({names.TTFT_PREDICTED: prediction.predicted_ttft_s,
                               names.TTFT_QUEUE: prediction.queue_s, names.TTFT_PREFILL: prediction.prefill_s,
                               names.TTFT_TRANSFER: prediction.transfer_s,
                               names.TTFT_TRANSFER_TOKENS: prediction.transfer_tokens})
        return attributes

    def _stage(self, name: str, start: float, end: float, attributes: dict[str, Any]) -> None:
        span = self._tracing.tracer.start_span(name, context=self._context, start_time=self._ns(start),
                                               attributes=attributes)
        span.end(end_time=self._ns(end))

    def rejected(self, code: str) -> None:
        self.span.set_attribute(names.REJECTION_CODE, code)

    def attempt(self, name: str, instance_id: str, url: str, number: int) -> AttemptSpan:
        """A client span for one request to an engine (`number`: 1 for the first try of the request)."""
        engine = URL(url)
        attributes = {names.INSTANCE: instance_id, names.ATTEMPT: number, names.HTTP_METHOD: "POST",
                      names.SERVER_ADDRESS: engine.host or "", names.SERVER_PORT: engine.port or 0}
        return AttemptSpan(self._tracing.tracer.start_span(name, context=self._context, kind=SpanKind.CLIENT,
                                                           attributes=attributes))

    def answered(self, status: int, outcome: str | None = None) -> None:
        """The answer's status (an answer sent in full, or a stream cut with `outcome`); ends the span."""
        if outcome is not None:
            self.span.set_attribute(names.OUTCOME, outcome)
        self._end(status)

    def _end(self, status: int | None, error_type: str | None = None) -> None:
        if self._ended:
            return
        self._ended = True
        if status is not None:
            self.span.set_attribute(names.HTTP_STATUS, status)
            if status >= 500:
                self.span.set_attribute(names.ERROR_TYPE, error_type or str(status))
                self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()

    def __enter__(self) -> RequestTrace:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self._end(None)
        elif not isinstance(exc, Exception):  # cancelled: the client left
            self.closed()
        else:  # an APIError carries its status and code; anything else is answered 500
            self.failed(getattr(exc, "status", 500), getattr(exc, "code", None) or type(exc).__qualname__)

    def closed(self) -> None:
        """The client left before its answer ended."""
        self.span.set_attribute(names.OUTCOME, names.CLIENT_CLOSED)
        self._end(None)

    def failed(self, status: int, code: str | None) -> None:
        """A refusal or a failure answered with `status` (an OpenAI error code in `code`)."""
        if code:
            self.span.set_attribute(names.ERROR_CODE, code)
        self._end(status, code)


class AttemptSpan:
    """One request sent to an engine. As a context manager it ends the span, marking an exception
    that leaves it (a failed attempt) as the span's error."""

    def __init__(self, span: Span) -> None:
        self.span = span

    def headers(self) -> dict[str, str]:
        """W3C trace context naming this span as the engine's parent (traceparent, and tracestate)."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(self.span))
        return carrier

    def header_lines(self) -> str:
        return "".join(f"{name}: {value}\r\n" for name, value in self.headers().items())

    def first_byte(self) -> None:
        self.span.add_event(names.FIRST_BYTE)

    def on_first_byte(self, then: Callable[[], None] | None) -> Callable[[], None]:
        """`then` (may be None), preceded by the first-byte event."""
        def first_byte() -> None:
            self.first_byte()
            if then is not None:
                then()

        return first_byte

    def answered(self, status: int, broken: str | None = None) -> None:
        """The engine's answer came with `status` (and its stream broke after the first byte: `broken`)."""
        self.span.set_attribute(names.HTTP_STATUS, status)
        if status >= 500:
            self.span.set_attribute(names.ERROR_TYPE, str(status))
            self.span.set_status(Status(StatusCode.ERROR))
        if broken is not None:
            self.span.set_attribute(names.OUTCOME, names.STREAM_BROKEN)
            self.span.set_status(Status(StatusCode.ERROR, broken))

    def end(self) -> None:
        self.span.end()

    def cancelled(self) -> None:
        """The attempt ended before its answer did (the client left, or a pair's other half ended first)."""
        self.span.set_attribute(names.OUTCOME, names.CANCELLED)
        self.span.end()

    def __enter__(self) -> AttemptSpan:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc is None:
            self.span.end()
        elif isinstance(exc, Exception):  # the attempt failed (another instance may be tried)
            self.span.set_attribute(names.ERROR_TYPE, type(exc).__qualname__)
            self.span.set_status(Status(StatusCode.ERROR, str(exc)))
            self.span.end()
        else:
            self.cancelled()
