"""Engines' KV events: decoders (one module per wire format), the shared index, the subscriber.

docs/KV_EVENTS.md describes the design; `DECODERS` is the registry of wire formats.
"""

from kvgate.config.settings import KVEventsFormat, KVSBackendName, Settings
from kvgate.kvs_client.events.base import EventDecoder
from kvgate.kvs_client.events.vllm import VllmDecoder

DECODERS: dict[KVEventsFormat, type[EventDecoder]] = {KVEventsFormat.VLLM: VllmDecoder}


def events_enabled(settings: Settings) -> bool:
    """Whether the gateway keeps an events index: no store, or some instance publishes events."""
    return settings.kvs_backend == KVSBackendName.KV_EVENTS or any(
        instance.kv_events_endpoint for instance in settings.instances)
