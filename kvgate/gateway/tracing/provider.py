"""The tracer provider of one gateway process: who records (the sampler), where spans go (OTLP over
http/protobuf or gRPC, as --otlp-traces-protocol says) and how (a batch queue, bounded, exported by the
SDK's own thread). `close()` flushes the queue and stops that thread.

The provider is the gateway's own, not OpenTelemetry's global one, so several gateways in one process
(tests, the demo) each trace with their own settings and libraries' instrumentation stays unaffected.
"""

from __future__ import annotations

import asyncio
import os

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from kvgate import __version__
from kvgate.config.settings import OTLPProtocol, Settings

# Spans waiting for export; past this many the newest are dropped (a collector that is down or slow
# must not grow the gateway's memory). At ~10 spans a request, a few seconds of a busy gateway.
MAX_QUEUED_SPANS = 8192
MAX_EXPORT_BATCH_SPANS = 512
# Export at least this often, so a trace is readable a second after its request.
EXPORT_INTERVAL_MS = 1000
# One export's time limit; the queue keeps filling meanwhile (and drops when full).
EXPORT_TIMEOUT_S = 10.0


class Tracing:
    """What a gateway's front doors trace with, and what the spans say about the deployment."""

    def __init__(self, provider: TracerProvider, policy: str, events_on: bool) -> None:
        self.tracer = provider.get_tracer("kvgate", __version__)
        self.policy = policy
        self.events_on = events_on
        self._provider = provider

    @classmethod
    def from_settings(cls, settings: Settings, events_on: bool) -> Tracing:
        resource = Resource({"service.name": settings.otlp_service_name, "service.version": __version__,
                             "process.pid": os.getpid()})
        provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(settings.otlp_traces_sample_ratio)),
                                  resource=resource, shutdown_on_exit=False)
        provider.add_span_processor(BatchSpanProcessor(
            _exporter(settings.otlp_traces_protocol, settings.otlp_traces_endpoint), max_queue_size=MAX_QUEUED_SPANS,
            schedule_delay_millis=EXPORT_INTERVAL_MS, max_export_batch_size=MAX_EXPORT_BATCH_SPANS))
        return cls(provider, settings.effective_policy, events_on)

    async def flush(self) -> None:
        """Export every span ended so far (off the event loop: the export is a blocking call)."""
        await asyncio.to_thread(self._provider.force_flush)

    async def close(self) -> None:
        """Flush, then stop the export thread; spans ended later are dropped."""
        await asyncio.to_thread(self._provider.shutdown)


def _exporter(protocol: OTLPProtocol, endpoint: str) -> SpanExporter:
    # The exporters also honour OpenTelemetry's variables for what kvgate has no setting for
    # (OTEL_EXPORTER_OTLP_TRACES_HEADERS, _CERTIFICATE, _COMPRESSION, _INSECURE).
    if protocol is OTLPProtocol.GRPC:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GRPCExporter

        return GRPCExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HTTPExporter

    return HTTPExporter(endpoint=endpoint, timeout=EXPORT_TIMEOUT_S)

