"""KV store clients: which endpoints hold a request's blocks (Mooncake master, Redis, embedded,
Mooncake's Conductor indexer).

Callers use `make_kvs_client(settings)` and `await client.lookup(keys, token_ids, model)`, which
always returns a KVSLookup within the time budget (see resilient.py). docs/KVS.md describes the
backends.
"""

from kvgate.kvs_client.base import (
    SHARED_STORAGE,
    Endpoints,
    HashedPrompt,
    KVSAnswer,
    KVSBackend,
    KVSLookup,
    KVSQueryError,
)
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.kvs_client.factory import make_backend, make_kvs_client
from kvgate.kvs_client.resilient import ResilientKVSClient

__all__ = [
    "SHARED_STORAGE",
    "EmbeddedKVSIndex",
    "Endpoints",
    "HashedPrompt",
    "KVSAnswer",
    "KVSBackend",
    "KVSLookup",
    "KVSQueryError",
    "ResilientKVSClient",
    "make_backend",
    "make_kvs_client",
]
