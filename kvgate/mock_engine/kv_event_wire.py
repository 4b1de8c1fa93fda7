"""vLLM's KV events on the wire: the msgpack payload of one ZMQ message (REFERENCE.md section 13).

A payload is a `KVEventBatch`, always an array `[ts, events, data_parallel_rank]`. Its events are
`BlockStored`, `BlockRemoved` and `AllBlocksCleared`, in one of two shapes:
- "map" (vLLM 0.32): a map whose first entry is `"type": <event name>`, then the fields in their
  declared order. Fields that have a default (from `extra_keys` on) are left out while they hold
  it, as vLLM's encoder omits defaults; so a full-attention model's BlockStored ends with
  `group_idx` and `kv_cache_spec_kind`.
- "array" (vLLM before the switch to maps): `[<event name>, field, field, ...]`, every field by
  position in the same order.

Block hashes are the low 64 bits of vLLM's 32-byte block hash as an int (vLLM's default), or the
32 raw bytes (vLLM with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import msgpack

EventEncoding = Literal["map", "array"]
HashFormat = Literal["int", "bytes"]
EVENT_ENCODINGS: tuple[EventEncoding, ...] = ("map", "array")
HASH_FORMATS: tuple[HashFormat, ...] = ("int", "bytes")

# What a full-attention model's blocks report (vLLM's KV cache spec kind of that group).
MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
_LOW_64_BITS = (1 << 64) - 1


def wire_hash(digest: bytes, hash_format: HashFormat) -> int | bytes:
    """A block's hash as its events carry it."""
    return int.from_bytes(digest, "big") & _LOW_64_BITS if hash_format == "int" else digest


@dataclass(frozen=True, slots=True)
class BlockStored:
    block_hashes: Sequence[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: Sequence[int]
    block_size: int
    group_idx: int = 0
    kv_cache_spec_kind: str = FULL_ATTENTION

    def fields(self) -> list[tuple[str, Any, bool]]:
        """(name, value, has a default) in vLLM's declared order."""
        return [
            ("block_hashes", list(self.block_hashes), False),
            ("parent_block_hash", self.parent_block_hash, False),
            ("token_ids", list(self.token_ids), False),
            ("block_size", self.block_size, False),
            ("lora_id", None, False),
            ("medium", MEDIUM_GPU, False),
            ("lora_name", None, False),
            ("extra_keys", None, True),
            ("group_idx", self.group_idx, True),
            ("kv_cache_spec_kind", self.kv_cache_spec_kind, True),
            ("kv_cache_spec_sliding_window", None, True),
        ]


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: Sequence[int | bytes]
    group_idx: int = 0

    def fields(self) -> list[tuple[str, Any, bool]]:
        return [
            ("block_hashes", list(self.block_hashes), False),
            ("medium", MEDIUM_GPU, False),
            ("group_idx", self.group_idx, True),
        ]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    def fields(self) -> list[tuple[str, Any, bool]]:
        return []


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


def _event_object(event: KVEvent, encoding: EventEncoding) -> dict[str, Any] | list[Any]:
    name = type(event).__name__
    if encoding == "array":
        return [name, *(value for _, value, _ in event.fields())]
    # A field with a default is omitted while it holds it (every default here is None).
    fields = event.fields()
    return {"type": name, **{key: value for key, value, optional in fields if value is not None or not optional}}


def encode_batch(
    ts: float, events: Sequence[KVEvent], encoding: EventEncoding, data_parallel_rank: int = 0
) -> bytes:
    """One KVEventBatch payload."""
    body = [float(ts), [_event_object(event, encoding) for event in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)
