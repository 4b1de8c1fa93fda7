"""Build the KV store client the settings ask for."""

from __future__ import annotations

from kvgate.config.settings import KVSBackendName, Settings
from kvgate.kvs_client.base import KVSBackend
from kvgate.kvs_client.conductor_indexer import ConductorIndexerBackend
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.kvs_client.redis_index import RedisIndexBackend
from kvgate.kvs_client.resilient import ResilientKVSClient
from kvgate.metrics.definitions import KVSMetrics


def make_backend(settings: Settings, embedded_index: EmbeddedKVSIndex | None = None) -> KVSBackend:
    # One outbound call may use the whole lookup budget; the resilient client cuts it there anyway.
    timeout_s = settings.kvs_query_budget_ms / 1000
    match settings.kvs_backend:
        case KVSBackendName.MOONCAKE:
            return MooncakeMasterBackend(
                f"http://{settings.kvs_metadata_service_http_server_host}:"
                f"{settings.kvs_metadata_service_http_server_port}",
                request_timeout_s=timeout_s,
                max_url_bytes=settings.kvs_batch_query_max_url_bytes,
                include_disk_tier=settings.kvs_query_disk_tier,
                max_answer_bytes=settings.kvs_max_answer_bytes,
            )
        case KVSBackendName.REDIS:
            return RedisIndexBackend(settings.kvs_redis_url, settings.kvs_redis_key_prefix, request_timeout_s=timeout_s)
        case KVSBackendName.EMBEDDED:
            return embedded_index if embedded_index is not None else EmbeddedKVSIndex()
        case KVSBackendName.CONDUCTOR:
            return ConductorIndexerBackend(
                settings.kvs_conductor_url,
                block_size=settings.kvs_chunk_size,
                request_timeout_s=timeout_s,
                tenant=settings.kvs_conductor_tenant,
                model=settings.kvs_conductor_model,
                lora_name=settings.kvs_conductor_lora_name,
                cache_salt=settings.kvs_conductor_cache_salt,
                include_disk_tier=settings.kvs_query_disk_tier,
                max_answer_bytes=settings.kvs_max_answer_bytes,
            )
        case KVSBackendName.KV_EVENTS:
            raise ValueError("kvs_backend kv_events asks no store: the gateway reads the engines' KV events "
                             "(kvgate/kvs_client/events/)")
    raise ValueError(f"unknown kvs_backend {settings.kvs_backend!r}")


def make_kvs_client(
    settings: Settings,
    metrics: KVSMetrics | None = None,
    embedded_index: EmbeddedKVSIndex | None = None,
) -> ResilientKVSClient:
    """The client for settings.kvs_backend; pass `embedded_index` to share one with engines."""
    return ResilientKVSClient(make_backend(settings, embedded_index), settings, metrics)
