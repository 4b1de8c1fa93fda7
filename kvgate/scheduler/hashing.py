"""Token ids -> chained block hashes, byte-identical to what the engines write.

Three algorithms (REFERENCE.md section 1). Each chains its chunks: a block's hash covers every
token before it, so equal hashes mean an equal prefix. The functions here return *raw* hash
strings; `key_formats` turns them into store keys (suffixes, prefixes, model names).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2
import xxhash

from kvgate.config.settings import HashAlgo

_UINT32_MAX = 2**32 - 1


@dataclass(frozen=True, slots=True)
class BlockHash:
    """One chunk's chained hash. `full` is false only for a saved unfull last chunk."""

    value: str
    num_tokens: int
    full: bool


def _chunks(token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool):
    whole = len(token_ids) - len(token_ids) % chunk_size
    for start in range(0, whole, chunk_size):
        yield token_ids[start : start + chunk_size], True
    if save_unfull_chunk and whole < len(token_ids):
        yield token_ids[whole:], False


def _cbor_sha256(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def cbor_seed_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH: the chain's root is the hash of the seed *string*."""
    return _cbor_sha256(seed or "0")


def hash_sha256_cbor(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0"
) -> list[BlockHash]:
    parent = cbor_seed_hash(seed)
    out = []
    for chunk, full in _chunks(token_ids, chunk_size, save_unfull_chunk):
        parent = _cbor_sha256([parent, list(chunk), None])
        out.append(BlockHash(parent.hex(), len(chunk), full))
    return out


def sha256_hex_block(token_ids: Sequence[int], prior_hex: str | None) -> str:
    """SGLang HiCache's page hash: sha256(prior digest bytes || tokens as uint32 LE)."""
    if any(t < 0 or t > _UINT32_MAX for t in token_ids):
        raise ValueError("sha256_hex hashes tokens as uint32: every token id must be in 0..2**32-1")
    digest = hashlib.sha256(bytes.fromhex(prior_hex) if prior_hex else b"")
    digest.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return digest.hexdigest()


def hash_sha256_hex(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0"
) -> list[BlockHash]:
    del seed  # SGLang's page chain has no seed
    prior: str | None = None
    out = []
    for chunk, full in _chunks(token_ids, chunk_size, save_unfull_chunk):
        prior = sha256_hex_block(chunk, prior)
        out.append(BlockHash(prior, len(chunk), full))
    return out


def hash_xxhash(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0"
) -> list[BlockHash]:
    del seed  # the iris stream is always seeded with 0
    stream = xxhash.xxh64(seed=0)
    out = []
    for chunk, full in _chunks(token_ids, chunk_size, save_unfull_chunk):
        stream.update(struct.pack(f"<{len(chunk)}q", *chunk))
        if not full:
            # The partial chunk is padded with zero tokens so every key covers whole chunks.
            stream.update(bytes(8 * (chunk_size - len(chunk))))
        out.append(BlockHash(str(stream.intdigest()), len(chunk), full))
    return out


_ALGORITHMS = {
    HashAlgo.SHA256_CBOR: hash_sha256_cbor,
    HashAlgo.SHA256_HEX: hash_sha256_hex,
    HashAlgo.XXHASH: hash_xxhash,
}


def hash_blocks(
    algo: HashAlgo | str,
    token_ids: Sequence[int],
    chunk_size: int,
    save_unfull_chunk: bool = False,
    seed: str = "0",
) -> list[BlockHash]:
    """Chained block hashes of `token_ids`, one per chunk (the unfull last one only when saved)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    return _ALGORITHMS[HashAlgo(algo)](token_ids, chunk_size, save_unfull_chunk, seed)
