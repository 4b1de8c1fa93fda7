"""The vLLM events decoder: both event encodings, both hash encodings, and garbage of every shape."""

from __future__ import annotations

import hashlib

import cbor2
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.kvs_client.events.base import (
    AllCleared,
    BlocksRemoved,
    BlocksStored,
    EventBatch,
    MalformedEvents,
    Medium,
)
from kvgate.kvs_client.events.keys import MASK64, engine_block_hashes, key_of
from kvgate.kvs_client.events.vllm import VllmDecoder
from tests.kv_events_engine import batch_payload, cleared, removed, stored

DECODER = VllmDecoder()
# REFERENCE.md section 1's golden vector: sha256_cbor of [1, 2, 3, 4] (chunk 4, seed "0").
GOLDEN = "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb"


def test_engine_hashes_are_the_low_64_bits_of_the_sha256_cbor_digest():
    digest = bytes.fromhex(GOLDEN)
    assert engine_block_hashes([1, 2, 3, 4, 5], 4) == [int(GOLDEN, 16) & MASK64]
    assert engine_block_hashes([1, 2, 3, 4, 5], 4, as_bytes=True) == [digest]
    assert key_of(digest) == key_of(int(GOLDEN, 16) & MASK64)
    # vLLM's own definition of the block hash, written out: sha256 over canonical CBOR.
    root = hashlib.sha256(cbor2.dumps("0", canonical=True)).digest()
    assert hashlib.sha256(cbor2.dumps([root, [1, 2, 3, 4], None], canonical=True)).digest() == digest


@pytest.mark.parametrize("encoding", ["map", "array"])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_both_encodings_decode_to_the_same_events(encoding, as_bytes):
    hashes = engine_block_hashes(list(range(64)), 16, as_bytes=as_bytes)
    payload = batch_payload([
        stored(hashes[:2], None, list(range(32)), 16, encoding=encoding),
        stored(hashes[2:], hashes[1], list(range(32, 64)), 16, medium="CPU", encoding=encoding),
        removed(hashes[3:], medium="STORAGE", encoding=encoding),
        removed(hashes[:1], medium=None, encoding=encoding),
        cleared(encoding),
    ], ts=1234.5)
    keys = [key_of(h) for h in hashes]
    assert DECODER.decode(payload) == EventBatch(1234.5, (
        BlocksStored((keys[0], keys[1]), None, Medium.GPU, 16),
        BlocksStored((keys[2], keys[3]), keys[1], Medium.CPU, 16),
        BlocksRemoved((keys[3],), Medium.DISK),
        BlocksRemoved((keys[0],), Medium.GPU),
        AllCleared(),
    ))


def test_a_batch_as_a_map_and_blocks_keyed_beyond_their_tokens():
    """LoRA names and cache salts (strings) are keys kvgate hashes too; images and prompt embeddings not."""
    payload = msgpack.packb({"ts": 1.0, "events": [
        stored([7], None, list(range(16)), 16, extra_keys=[[["image-sha", 0]]]),
        stored([8], None, list(range(16)), 16, extra_keys=[None]),
        stored([9], None, list(range(32)), 16, lora_name="sql", extra_keys=[["sql", "salt"], ["sql"]]),
        stored([10], None, list(range(16)), 16, extra_keys=[[b"embeds-digest"]]),
    ], "data_parallel_rank": 0})
    batch = DECODER.decode(payload)
    assert [event.keyed_beyond_tokens for event in batch.events] == [True, False, False, True]


@pytest.mark.parametrize("payload, reason", [
    (b"\xc1", "not_msgpack"),
    (msgpack.packb([1.0]), "bad_batch"),
    (msgpack.packb(["now", []]), "bad_batch"),
    (msgpack.packb([1.0, [5]]), "bad_event"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [], "medium": "GPU"}]]), "bad_event"),
    (msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [-3], "medium": "GPU"}]]), "bad_hash"),
    (msgpack.packb([1.0, [{"type": "BlockStored", "block_hashes": [1], "parent_block_hash": None,
                           "token_ids": [], "block_size": 0}]]), "bad_event"),
])
def test_malformed_payloads_say_why(payload, reason):
    with pytest.raises(MalformedEvents) as caught:
        DECODER.decode(payload)
    assert caught.value.reason == reason


def _decodes_or_refuses(payload: bytes) -> None:
    try:
        batch = DECODER.decode(payload)
    except MalformedEvents:
        return
    assert isinstance(batch, EventBatch)
    for event in batch.events:
        assert isinstance(event, BlocksStored | BlocksRemoved | AllCleared)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_escape_as_another_error(payload):
    _decodes_or_refuses(payload)


_LEAVES = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1), st.floats(allow_nan=False),
                    st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "CPU", "type"]),
                    st.binary(max_size=40))
_VALUES = st.recursive(_LEAVES, lambda inner: st.one_of(
    st.lists(inner, max_size=6),
    st.dictionaries(st.sampled_from(["type", "block_hashes", "parent_block_hash", "token_ids", "block_size",
                                     "medium", "lora_name", "extra_keys", "group_idx", "ts", "events"]),
                    inner, max_size=6)), max_leaves=30)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(allow_nan=False, allow_infinity=False), st.lists(_VALUES, max_size=5))
def test_random_msgpack_batches_never_escape_as_another_error(ts, events):
    _decodes_or_refuses(msgpack.packb([ts, events, 0]))
