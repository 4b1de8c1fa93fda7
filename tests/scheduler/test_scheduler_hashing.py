"""Token hashing: the golden vectors of REFERENCE.md section 1, and the fast encoders against plain ones."""

from __future__ import annotations

import hashlib
import struct
from unittest.mock import patch

import cbor2
import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.scheduler import hashing
from kvgate.scheduler.hashing import (
    cbor_head,
    cbor_seed_hash,
    cbor_uints,
    hash_blocks,
    sha256_hex_block,
)

# Ints on both sides of every CBOR head-size boundary, where an encoder is most likely wrong.
_BOUNDARIES = [23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1]
_near_boundary = st.sampled_from(_BOUNDARIES).flatmap(
    lambda b: st.integers(max(0, b - 2), min(2**64 - 1, b + 2))
)
uint64s = st.one_of(_near_boundary, st.integers(0, 2**64 - 1), st.integers(0, 200_000))


def values(blocks):
    return [b.value for b in blocks]


# --- golden vectors ---------------------------------------------------------------------------


def test_cbor_seed_hash_golden():
    assert cbor_seed_hash("0").hex() == "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"
    assert cbor_seed_hash("") == cbor_seed_hash("0")


@pytest.mark.parametrize(
    ("tokens", "chunk", "save", "seed", "expected"),
    [
        (
            [1, 2, 3, 4, 5],
            4,
            True,
            "0",
            [
                "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb",
                "105474563044be49e8741387f67df29d2f9eb696528c310bda92aa1ce554cee6",
            ],
        ),
        (
            [1, 2, 3, 4, 5],
            4,
            True,
            "seed-1",
            [
                "cd5274edd02cd2be740010d36770ca489dbf581625cf482bce3e1d08c671787b",
                "fc72dcda3456ca6a75fbc3fd645c2a40660b0e8c1a21b3c7aa6e4f532116c915",
            ],
        ),
        (
            [10, 11, 12, 13],
            4,
            False,
            "0",
            ["398c246ffafbdd52fd77aeeb90e6a134c3cfffac128d0a960292db8f8fb2077a"],
        ),
        (
            list(range(32)),
            16,
            False,
            "0",
            [
                "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c",
                "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac",
            ],
        ),
    ],
)
def test_sha256_cbor_golden(tokens, chunk, save, seed, expected):
    assert values(hash_blocks("sha256_cbor", tokens, chunk, save, seed)) == expected


def test_sha256_hex_golden():
    assert sha256_hex_block([], None) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    assert (
        sha256_hex_block([1, 2, 3, 255, 256, 65535, 65536], None)
        == "5ba3e9b021ff6d39ef14249fe00d3329a3a0cf30f3ab1b27ea66f84f33c1fdd7"
    )
    blocks = hash_blocks("sha256_hex", [1, 2, 3, 4, 5], 4, True)
    assert values(blocks) == [
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
        "cb701dbfc2cfd59232c74951be0f3129877ac68f27bee77757d30fb46580a0f2",
    ]
    assert [(b.num_tokens, b.full) for b in blocks] == [(4, True), (1, False)]


def test_xxhash_golden():
    assert values(hash_blocks("xxhash", [1, 2, 3, 4], 4)) == ["8356527653647720045"]
    assert values(hash_blocks("xxhash", [1, 2, 3, 4, 5], 2, True)) == [
        "5411092459628516524",
        "8356527653647720045",
        "2958923896811523840",
    ]
    assert values(hash_blocks("xxhash", [1, 2, 3], 1)) == [
        "11468921228449061269",
        "5411092459628516524",
        "9771088612715187706",
    ]


def test_unfull_chunk_dropped_unless_saved():
    assert len(hash_blocks("sha256_cbor", list(range(10)), 4)) == 2
    saved = hash_blocks("sha256_cbor", list(range(10)), 4, save_unfull_chunk=True)
    assert [(b.num_tokens, b.full) for b in saved] == [(4, True), (4, True), (2, False)]
    assert hash_blocks("sha256_cbor", [], 4, True) == []


def test_out_of_range_tokens_are_value_errors():
    with pytest.raises(ValueError, match="uint32"):
        hash_blocks("sha256_hex", [1, -1], 2)
    with pytest.raises(ValueError, match="uint32"):
        hash_blocks("sha256_hex", [2**32], 1)
    with pytest.raises(ValueError, match="int64"):
        hash_blocks("xxhash", [2**63], 1)
    with pytest.raises(ValueError, match="chunk_size"):
        hash_blocks("xxhash", [1], 0)


# --- the fast paths against the plain definitions ------------------------------------------------


def _plain_sha256_cbor(tokens, chunk, save, seed):
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if len(part) < chunk and not save:
            break
        parent = hashlib.sha256(cbor2.dumps([parent, part, None], canonical=True)).digest()
        out.append(parent.hex())
    return out


def _plain_sha256_hex(tokens, chunk, save):
    prior, out = None, []
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if len(part) < chunk and not save:
            break
        data = (bytes.fromhex(prior) if prior else b"") + b"".join(struct.pack("<I", t) for t in part)
        prior = hashlib.sha256(data).hexdigest()
        out.append(prior)
    return out


def _plain_xxhash(tokens, chunk, save):
    stream, out = xxhash.xxh64(seed=0), []
    for start in range(0, len(tokens), chunk):
        part = tokens[start : start + chunk]
        if len(part) < chunk and not save:
            break
        stream.update(b"".join(struct.pack("<q", t) for t in part) + bytes(8 * (chunk - len(part))))
        out.append(str(stream.intdigest()))
    return out


@given(st.lists(uint64s, max_size=300))
def test_cbor_uints_equal_cbor2(ints):
    encoded, ends = cbor_uints(np.array(ints, dtype="<u8"))
    pieces = [cbor2.dumps(i, canonical=True) for i in ints]
    assert encoded == b"".join(pieces)
    assert ends.tolist() == np.cumsum([len(p) for p in pieces]).tolist()


@given(st.one_of(_near_boundary, st.integers(0, 2**64 - 1)))
def test_cbor_uint_head_equals_cbor2(argument):
    assert cbor_head(0, argument) == cbor2.dumps(argument, canonical=True)


@pytest.mark.parametrize("length", [0, 1, 23, 24, 255, 256, 65535, 65536])
def test_cbor_array_head_equals_cbor2(length):
    head = cbor_head(4, length)
    assert cbor2.dumps([0] * length, canonical=True) == head + bytes(length)


@settings(max_examples=60)
@given(
    st.lists(uint64s, max_size=200),
    st.integers(1, 40),
    st.booleans(),
    st.sampled_from(["0", "seed-1", "42"]),
)
def test_sha256_cbor_equals_plain_cbor2(tokens, chunk, save, seed):
    assert values(hash_blocks("sha256_cbor", tokens, chunk, save, seed)) == _plain_sha256_cbor(
        tokens, chunk, save, seed
    )


@settings(max_examples=30)
@given(st.lists(st.integers(-(2**70), 2**70), max_size=50), st.integers(1, 8), st.booleans())
def test_sha256_cbor_falls_back_to_cbor2_for_any_int(tokens, chunk, save):
    assert values(hash_blocks("sha256_cbor", tokens, chunk, save)) == _plain_sha256_cbor(
        tokens, chunk, save, "0"
    )


@settings(max_examples=60)
@given(st.lists(st.integers(0, 2**32 - 1), max_size=200), st.integers(1, 40), st.booleans())
def test_sha256_hex_equals_plain(tokens, chunk, save):
    assert values(hash_blocks("sha256_hex", tokens, chunk, save)) == _plain_sha256_hex(tokens, chunk, save)


@settings(max_examples=60)
@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=200), st.integers(1, 40), st.booleans())
def test_xxhash_equals_plain(tokens, chunk, save):
    assert values(hash_blocks("xxhash", tokens, chunk, save)) == _plain_xxhash(tokens, chunk, save)


def test_long_prompt_equals_plain():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 160_000, size=256 * 20 + 17).tolist()
    assert values(hash_blocks("sha256_cbor", tokens, 256, True)) == _plain_sha256_cbor(tokens, 256, True, "0")


@pytest.mark.parametrize(("length", "chunk"), [(8192 * 3 + 5, 256), (8192 * 2 + 3, 7), (25_000, 10_000)])
@pytest.mark.parametrize("save", [False, True])
def test_prompts_spanning_several_encode_groups_equal_plain(length, chunk, save):
    # Encoding runs in groups of ~8192 tokens; chunks and the unfull tail must cross them intact.
    tokens = np.random.default_rng(length).integers(0, 2**20, size=length).tolist()
    assert values(hash_blocks("sha256_cbor", tokens, chunk, save)) == _plain_sha256_cbor(
        tokens, chunk, save, "0"
    )


@settings(max_examples=60)
@given(st.lists(uint64s, max_size=120), st.integers(1, 9), st.booleans())
def test_sha256_cbor_with_tiny_encode_groups_equals_plain(tokens, chunk, save):
    with patch.object(hashing, "_CBOR_TOKENS_PER_ENCODE", 8):
        fast = values(hash_blocks("sha256_cbor", tokens, chunk, save))
    assert fast == _plain_sha256_cbor(tokens, chunk, save, "0")
