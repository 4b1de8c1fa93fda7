"""The ext_proc messages the endpoint picker reads and writes; no other module knows the protos.

Header and metadata names are the Gateway API Inference Extension's endpoint-picker protocol.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from envoy.config.core.v3.base_pb2 import HeaderMap, HeaderValue, HeaderValueOption
from envoy.service.ext_proc.v3.external_processor_pb2 import (
    BodyMutation,
    BodyResponse,
    CommonResponse,
    HeaderMutation,
    HeadersResponse,
    ImmediateResponse,
    ProcessingRequest,
    ProcessingResponse,
    StreamedBodyResponse,
    TrailersResponse,
)
from envoy.type.v3.http_status_pb2 import HttpStatus
from google.protobuf.struct_pb2 import Struct

DESTINATION_HEADER = "x-gateway-destination-endpoint"
# Where Envoy's load balancing (an override-host policy) reads the pick; the header is ORIGINAL_DST's.
DESTINATION_NAMESPACE = "envoy.lb"
# Set by a gateway that restricts the pick (e.g. to endpoints it considers ready).
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
# Envoy's default limit on one body message is 64 KiB; chunks stay under it.
MAX_CHUNK_BYTES = 62 * 1024

_OVERWRITE = HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD


def header_values(headers: HeaderMap) -> dict[str, str]:
    """Envoy's headers by lower-case name (raw_value bytes as Envoy sends them, or value)."""
    return {h.key.lower(): h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
            for h in headers.headers}


def subset_hint(request: ProcessingRequest) -> frozenset[str] | None:
    """The endpoints Envoy allows for this request, None when it does not restrict them."""
    namespace = request.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    if value.HasField("list_value"):
        return frozenset(item.string_value for item in value.list_value.values if item.string_value)
    return frozenset(part.strip() for part in value.string_value.split(",") if part.strip())


def destination(endpoints: list[str], trace_context: Mapping[str, str] | None = None) -> ProcessingResponse:
    """The answer to the request's headers, and a new route lookup that sees the pick. The header
    holds the pick alone: Envoy's ORIGINAL_DST cluster parses it as one address (a comma-separated
    list fails the request with 503). The `envoy.lb` metadata holds the ordered list, fallbacks
    included, for load-balancing policies that retry on the next (Envoy's override-host policy).
    The body goes back unchanged, so its length and encoding stand. `trace_context` (traceparent,
    tracestate) replaces the request's own, so the engine's spans are children of the picker's."""
    metadata = Struct()
    metadata.get_or_create_struct(DESTINATION_NAMESPACE)[DESTINATION_HEADER] = ",".join(endpoints)
    mutation = HeaderMutation(set_headers=[_header(DESTINATION_HEADER, endpoints[0]),
                                           *(_header(name, value) for name, value in (trace_context or {}).items())])
    return ProcessingResponse(
        request_headers=HeadersResponse(response=CommonResponse(header_mutation=mutation, clear_route_cache=True)),
        dynamic_metadata=metadata,
    )


def request_body_chunks(body: bytes, end_of_stream: bool) -> Iterator[ProcessingResponse]:
    """The buffered request body streamed back to Envoy (a body not sent back reaches the engine empty)."""
    if not body:
        yield ProcessingResponse(request_body=_streamed(b"", end_of_stream))
        return
    for start in range(0, len(body), MAX_CHUNK_BYTES):
        end = start + MAX_CHUNK_BYTES
        yield ProcessingResponse(request_body=_streamed(body[start:end], end_of_stream and end >= len(body)))


def response_body_chunk(body: bytes, end_of_stream: bool) -> ProcessingResponse:
    """One chunk of the engine's answer, passed on unchanged."""
    return ProcessingResponse(response_body=_streamed(body, end_of_stream))


def response_headers_unchanged() -> ProcessingResponse:
    return ProcessingResponse(response_headers=HeadersResponse())


def request_trailers_unchanged() -> ProcessingResponse:
    return ProcessingResponse(request_trailers=TrailersResponse())


def response_trailers_unchanged() -> ProcessingResponse:
    return ProcessingResponse(response_trailers=TrailersResponse())


def immediate(status: int, body: bytes, headers: dict[str, str]) -> ProcessingResponse:
    """Envoy answers the client itself (`body` is OpenAI-style JSON); nothing goes to an engine."""
    mutation = HeaderMutation(set_headers=[_header("content-type", "application/json"),
                                           *(_header(name.lower(), value) for name, value in headers.items())])
    return ProcessingResponse(immediate_response=ImmediateResponse(
        status=HttpStatus(code=status), headers=mutation, body=body))


def _streamed(body: bytes, end_of_stream: bool) -> BodyResponse:
    return BodyResponse(response=CommonResponse(body_mutation=BodyMutation(
        streamed_response=StreamedBodyResponse(body=body, end_of_stream=end_of_stream))))


def _header(name: str, value: str) -> HeaderValueOption:
    return HeaderValueOption(header=HeaderValue(key=name, raw_value=value.encode()), append_action=_OVERWRITE)
