"""A real OTLP traces receiver on loopback for tests: OTLP/HTTP (POST /v1/traces, protobuf) and OTLP/gRPC
(`TraceService/Export`), decoding each ExportTraceServiceRequest with opentelemetry-proto and keeping
every span, so tests can assert names, attributes, events and parent links of what was exported.

    async with running_receiver() as receiver:
        settings = Settings(..., otlp_traces_endpoint=receiver.http_endpoint)          # http/protobuf
        settings = Settings(..., otlp_traces_endpoint=receiver.grpc_endpoint, otlp_traces_protocol="grpc")
        ...
        [server] = await receiver.wait_for(lambda s: s.kind == "server", count=1)

Run alone (`python -m tests.otlp_receiver --port 4318 --grpc-port 4317`) it serves until SIGINT or SIGTERM
and prints how many spans it received: the sink `kvgate bench overhead --otlp-traces-endpoint` exports to.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gzip
import signal
import time
import zlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.trace.v1 import trace_pb2

_KINDS = {trace_pb2.Span.SPAN_KIND_INTERNAL: "internal", trace_pb2.Span.SPAN_KIND_SERVER: "server",
          trace_pb2.Span.SPAN_KIND_CLIENT: "client", trace_pb2.Span.SPAN_KIND_PRODUCER: "producer",
          trace_pb2.Span.SPAN_KIND_CONSUMER: "consumer", trace_pb2.Span.SPAN_KIND_UNSPECIFIED: "unspecified"}
_STATUS = {trace_pb2.Status.STATUS_CODE_UNSET: "unset", trace_pb2.Status.STATUS_CODE_OK: "ok",
           trace_pb2.Status.STATUS_CODE_ERROR: "error"}


@dataclass(frozen=True)
class ReceivedSpan:
    service: str  # the resource's service.name
    name: str
    kind: str  # internal | server | client | producer | consumer | unspecified
    trace_id: str  # 32 hex digits
    span_id: str  # 16 hex digits
    parent_span_id: str  # "" for a root span
    attributes: dict[str, Any]
    events: tuple[str, ...]
    status: str  # unset | ok | error
    start_ns: int
    end_ns: int
    transport: str  # "http" or "grpc": how it reached the receiver

    @property
    def traceparent(self) -> str:
        """The W3C traceparent naming this span as a parent (sampled)."""
        return f"00-{self.trace_id}-{self.span_id}-01"


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return getattr(value, kind) if kind is not None else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs if isinstance(pair, KeyValue)}


def decode(request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> list[ReceivedSpan]:
    spans = []
    for resource_spans in request.resource_spans:
        service = str(_attributes(resource_spans.resource.attributes).get("service.name", ""))
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(ReceivedSpan(
                    service, span.name, _KINDS.get(span.kind, str(span.kind)), span.trace_id.hex(), span.span_id.hex(),
                    span.parent_span_id.hex(), _attributes(span.attributes), tuple(e.name for e in span.events),
                    _STATUS.get(span.status.code, str(span.status.code)), span.start_time_unix_nano,
                    span.end_time_unix_nano, transport))
    return spans


@dataclass
class OTLPReceiver:
    host: str = "127.0.0.1"
    http_port: int = 0  # 0: a free one
    grpc_port: int = 0
    spans: list[ReceivedSpan] = field(default_factory=list)
    exports: int = 0  # export requests accepted
    received_spans: int = 0
    keep: bool = True  # False: count spans only (a long benchmark's sink)
    http_endpoint: str = ""  # for http/protobuf: the full URL, /v1/traces included
    grpc_endpoint: str = ""  # for grpc: http://host:port (http:// = no TLS)
    _runner: web.AppRunner | None = None
    _grpc: grpc.aio.Server | None = None

    async def start(self, grpc_too: bool = True) -> OTLPReceiver:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/v1/traces", self._export_http)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.http_port).start()
        self.http_endpoint = f"http://{self.host}:{self._runner.addresses[0][1]}/v1/traces"
        if grpc_too:
            self._grpc = grpc.aio.server()
            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), self._grpc)
            port = self._grpc.add_insecure_port(f"{self.host}:{self.grpc_port}")
            await self._grpc.start()
            self.grpc_endpoint = f"http://{self.host}:{port}"
        return self

    async def close(self) -> None:
        if self._grpc is not None:
            await self._grpc.stop(None)
        if self._runner is not None:
            await self._runner.cleanup()

    def received(self, request: trace_service_pb2.ExportTraceServiceRequest, transport: str) -> None:
        spans = decode(request, transport)
        self.received_spans += len(spans)
        self.exports += 1
        if self.keep:
            self.spans.extend(spans)

    async def _export_http(self, request: web.Request) -> web.Response:
        if request.content_type != "application/x-protobuf":
            return web.Response(status=415, text="OTLP/HTTP protobuf only")
        body = await request.read()
        encoding = request.headers.get("Content-Encoding", "")
        if encoding == "gzip":
            body = gzip.decompress(body)
        elif encoding == "deflate":
            body = zlib.decompress(body)
        message = trace_service_pb2.ExportTraceServiceRequest()
        try:
            message.ParseFromString(body)
        except Exception:
            return web.Response(status=400, text="not an ExportTraceServiceRequest")
        self.received(message, "http")
        return web.Response(body=trace_service_pb2.ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    def named(self, name: str, service: str | None = None) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.name == name and (service is None or s.service == service)]

    def in_trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def children(self, parent: ReceivedSpan) -> list[ReceivedSpan]:
        return [s for s in self.spans if s.trace_id == parent.trace_id and s.parent_span_id == parent.span_id]

    async def wait_for(self, match: Callable[[ReceivedSpan], bool], count: int = 1,
                       timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """The spans matching `match` once at least `count` arrived (exporters batch: allow seconds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            found = [s for s in self.spans if match(s)]
            if len(found) >= count:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(found)} matching span(s) of {count} after {timeout_s} s; received "
                                     f"{sorted({(s.service, s.name) for s in self.spans})}")
            await asyncio.sleep(0.05)


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OTLPReceiver) -> None:
        self._receiver = receiver

    async def Export(self, request, context):  # noqa: N802 (the gRPC method's name)
        self._receiver.received(request, "grpc")
        return trace_service_pb2.ExportTraceServiceResponse()


@contextlib.asynccontextmanager
async def running_receiver(grpc_too: bool = True) -> AsyncIterator[OTLPReceiver]:
    receiver = await OTLPReceiver().start(grpc_too)
    try:
        yield receiver
    finally:
        await receiver.close()


async def _serve(http_port: int, grpc_port: int) -> None:
    receiver = await OTLPReceiver(http_port=http_port, grpc_port=grpc_port, keep=False).start()
    print(f"OTLP receiver: {receiver.http_endpoint} (http/protobuf), {receiver.grpc_endpoint} (grpc)", flush=True)
    stop = asyncio.Event()
    for signal_number in (signal.SIGINT, signal.SIGTERM):
        asyncio.get_running_loop().add_signal_handler(signal_number, stop.set)
    try:
        await stop.wait()
    finally:
        print(f"received {receiver.received_spans} span(s) in {receiver.exports} export(s)", flush=True)
        await receiver.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="an OTLP traces receiver that keeps what it receives")
    parser.add_argument("--port", type=int, default=4318, help="OTLP/HTTP port")
    parser.add_argument("--grpc-port", type=int, default=4317, help="OTLP/gRPC port")
    args = parser.parse_args()
    asyncio.run(_serve(args.port, args.grpc_port))
