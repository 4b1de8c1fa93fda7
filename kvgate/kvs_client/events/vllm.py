"""vLLM's KV events (vllm/distributed/kv_events.py, checked on 0.32).

A payload is a `KVEventBatch` in msgpack: `[ts, events, data_parallel_rank]` (a map with those
names is read too). Each event is a map tagged by "type" (vLLM 0.32) or, in older versions, an
array whose first item is the type followed by the fields in declaration order:

    BlockStored       block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
                      lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...
    BlockRemoved      block_hashes, medium, group_idx, ...
    AllBlocksCleared  (nothing)

Trailing fields at their defaults are left out by the encoder; later versions append fields, which
are ignored. Hashes are ints or 32-byte strings (keys.py). Only KV cache group 0 is indexed: a
hybrid model's other groups (sliding windows) hold the same hashes for shorter spans.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvgate.kvs_client.events.base import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    Event,
    EventBatch,
    MalformedEvents,
    Medium,
)
from kvgate.kvs_client.events.keys import key_of

_STORED_FIELDS = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                  "lora_name", "extra_keys", "group_idx")
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_MEDIA = {None: Medium.GPU, "GPU": Medium.GPU, "CPU": Medium.CPU}  # any other named medium: a disk tier
# Bounds on what one payload may unpack to (the socket bounds its bytes): a hostile peer cannot make
# msgpack build a billion-item list.
_MAX_ITEMS = 1 << 22


class VllmDecoder:

    def decode(self, payload: bytes) -> EventBatch:
        try:
            batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, max_array_len=_MAX_ITEMS,
                                    max_map_len=_MAX_ITEMS, max_bin_len=len(payload), max_str_len=len(payload))
        except (ValueError, msgpack.UnpackException, TypeError) as exc:
            raise MalformedEvents("not_msgpack", str(exc)) from None
        if isinstance(batch, dict):
            batch = [batch.get("ts"), batch.get("events")]
        if not isinstance(batch, list) or len(batch) < 2:
            raise MalformedEvents("bad_batch", "expected [ts, events, data_parallel_rank]")
        timestamp, raw_events = batch[0], batch[1]
        if not isinstance(timestamp, int | float) or isinstance(timestamp, bool) or not isinstance(raw_events, list):
            raise MalformedEvents("bad_batch", "ts must be a number and events a list")
        events: list[Event] = []
        ignored = 0
        for raw in raw_events:
            event = _event(raw)
            if event is None:
                ignored += 1
            else:
                events.append(event)
        return EventBatch(float(timestamp), tuple(events), ignored)


def _event(raw: Any) -> Event | None:
    """One event, or None for one the index ignores (another KV cache group, an unknown type)."""
    if isinstance(raw, dict):
        kind, fields = raw.get("type"), raw
    elif isinstance(raw, list) and raw:
        kind = raw[0]
        names = _STORED_FIELDS if kind == "BlockStored" else _REMOVED_FIELDS if kind == "BlockRemoved" else ()
        fields = dict(zip(names, raw[1:], strict=False))
    else:
        raise MalformedEvents("bad_event", "an event is a map or an array")
    if kind == "AllBlocksCleared":
        return AllCleared()
    if kind not in ("BlockStored", "BlockRemoved"):
        return None  # a type added by a later version
    if fields.get("group_idx") not in (None, 0):
        return None
    hashes = _hashes(fields.get("block_hashes"))
    medium = _medium(fields.get("medium"))
    if kind == "BlockRemoved":
        return BlocksRemoved(hashes, medium)
    parent = fields.get("parent_block_hash")
    block_size = fields.get("block_size")
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size < 1:
        raise MalformedEvents("bad_event", "BlockStored.block_size must be a positive int")
    # vLLM lists each block's extra keys untagged: a LoRA adapter's name and a cache salt as strings
    # (kvgate hashes those too), an image as [identifier, offset], prompt embeddings as bytes.
    extra_keys = fields.get("extra_keys")
    beyond = isinstance(extra_keys, list) and any(
        keys is not None and not (isinstance(keys, list) and all(isinstance(key, str) for key in keys))
        for keys in extra_keys)
    return BlocksStored(hashes, None if parent is None else _hash(parent), medium, block_size, beyond)


def _hashes(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise MalformedEvents("bad_event", "block_hashes must be a non-empty list")
    return tuple(map(_hash, value))


def _hash(value: Any) -> int:
    if isinstance(value, bytes) or (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
        return key_of(value)
    raise MalformedEvents("bad_hash", f"a block hash must be a non-negative int or bytes, not {type(value).__name__}")


def _medium(value: Any) -> Medium:
    if value is None or isinstance(value, str):
        return _MEDIA.get(value, Medium.DISK)
    raise MalformedEvents("bad_event", "medium must be a string or nil")
