"""OpenTelemetry tracing of requests, off unless --otlp-traces-endpoint is set (docs/OPERATIONS.md, "Tracing").

- provider.py: the tracer provider of one gateway process (sampler, OTLP exporter over http/protobuf
  or gRPC, a bounded batch queue) and its shutdown, which flushes what is queued;
- spans.py: one request's spans (the server span, the planner's stages, each attempt sent to an engine)
  and every span and attribute name kvgate writes.

The OpenTelemetry packages (the `tracing` extra) are imported only when tracing is on, so a gateway
without them pays nothing: its front doors hold `None` instead of a `Tracing` and branch once on it.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from kvgate.config.settings import Settings

if TYPE_CHECKING:
    from kvgate.gateway.tracing.provider import Tracing

_NEEDED = ("opentelemetry.sdk", "opentelemetry.exporter.otlp.proto.http",
           "opentelemetry.exporter.otlp.proto.grpc")


def check_tracing(settings: Settings) -> None:
    """Refuse (ValueError) a traces endpoint when the packages exporting to it are missing."""
    if not settings.otlp_traces_endpoint:
        return
    for module in _NEEDED:
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            raise ValueError(f"--otlp-traces-endpoint needs the tracing extra ({module} is missing): "
                             "pip install 'kvgate[tracing]'")


def start_tracing(settings: Settings, events_on: bool) -> Tracing | None:
    """The process's tracing when --otlp-traces-endpoint is set, else None. `events_on`: the gateway
    reads the engines' KV events (spans then say what the events index answered)."""
    if not settings.otlp_traces_endpoint:
        return None
    check_tracing(settings)
    from kvgate.gateway.tracing.provider import Tracing

    return Tracing.from_settings(settings, events_on)
