"""Token ids -> chained block hashes, byte-identical to what the engines write.

Three algorithms (REFERENCE.md section 1). Each chains its chunks: a block's hash covers every
token before it, so equal hashes mean an equal prefix. The functions here return *raw* hash
strings; `key_formats` turns them into store keys (suffixes, prefixes, model names).

Speed matters: a 128K-token prompt is hashed on the request path. Each algorithm therefore packs
the whole token array once and feeds byte slices of it to the hash, instead of re-encoding token by
token in Python.
"""

from __future__ import annotations

import array
import functools
import hashlib
import operator
import struct
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import cbor2
import numpy as np
import xxhash

from kvgate.config.settings import HashAlgo


@dataclass(frozen=True, slots=True)
class BlockHash:
    """One chunk's chained hash. `full` is false only for a saved unfull last chunk."""

    value: str
    num_tokens: int
    full: bool


@dataclass(frozen=True, slots=True)
class BlockExtras:
    """What vLLM mixes into a block's hash beside its tokens (its `extra_keys`), for the requests
    that carry them: a LoRA adapter, ("lora", name, path), in every block; a cache salt,
    ("cache_salt", salt), in the first. Only sha256_cbor has such a slot."""

    lora: tuple[str, str] | None = None  # (adapter name, the path the engine loaded it from)
    cache_salt: str | None = None

    def __bool__(self) -> bool:
        return self.lora is not None or bool(self.cache_salt)

    def keys(self, first_block: bool) -> list[list[str]] | None:
        """The block's extra keys, in vLLM's order; None (CBOR null) when it has none."""
        keys = [["lora", *self.lora]] if self.lora is not None else []
        if first_block and self.cache_salt:
            keys.append(["cache_salt", self.cache_salt])
        return keys or None


def _cbor_tails(extras: BlockExtras | None) -> tuple[bytes, bytes]:
    """The encoded third item of the hashed triple: for the first block, and for every later one."""
    if not extras:
        return _CBOR_NULL, _CBOR_NULL
    return (cbor2.dumps(extras.keys(True), canonical=True), cbor2.dumps(extras.keys(False), canonical=True))


def _chunk_bounds(num_tokens: int, chunk_size: int, save_unfull_chunk: bool) -> Iterator[tuple[int, int]]:
    """(start, end) token index of each hashed chunk; the unfull tail only when it is saved."""
    whole = num_tokens - num_tokens % chunk_size
    yield from ((start, start + chunk_size) for start in range(0, whole, chunk_size))
    if save_unfull_chunk and whole < num_tokens:
        yield whole, num_tokens


def _packed_le(token_ids: Sequence[int], code: str, what: str) -> bytes:
    """The whole prompt packed once as little-endian `code` ints (struct syntax)."""
    try:
        return struct.pack(f"<{len(token_ids)}{code}", *token_ids)
    except struct.error:
        raise ValueError(f"{what}: a token id is out of range") from None


# --- sha256_cbor (vLLM) -------------------------------------------------------------------------
#
# Each block hashes cbor2.dumps([parent (32 bytes), [token ints], None], canonical=True). That value
# has a fixed shape, so it is assembled here from its parts: the array head, the byte-string head
# and parent, the list head, every token's canonical uint encoding, and the `null` byte. The token
# encodings are computed for the whole prompt at once with numpy; tests check the result is
# byte-equal to cbor2's. Negative or >= 2**64 ids (never real tokens) go through cbor2 itself.

_CBOR_TRIPLE_AND_BYTES32_HEAD = b"\x83\x58\x20"  # array of 3 items, then a 32-byte string
_CBOR_NULL = b"\xf6"
# A uint below 24 is its own head byte (class 0). Above, the head says how many big-endian
# argument bytes follow: classes 1..4 start at these limits.
_UINT_CLASS_LIMITS = (24, 2**8, 2**16, 2**32)
_UINT_CLASS_WIDTH = np.array([0, 1, 2, 4, 8], dtype=np.int64)
_UINT_CLASS_HEAD = np.array([0, 0x18, 0x19, 0x1A, 0x1B], dtype=np.uint8)


def cbor_head(major_type: int, argument: int) -> bytes:
    """Canonical (shortest) CBOR head of a data item, e.g. major type 4 = array of `argument` items."""
    initial = major_type << 5
    if argument < 24:
        return bytes((initial | argument,))
    for code, fmt in ((24, ">B"), (25, ">H"), (26, ">I"), (27, ">Q")):
        if argument < 1 << (8 * struct.calcsize(fmt)):
            return bytes((initial | code,)) + struct.pack(fmt, argument)
    raise ValueError("a CBOR head argument must be below 2**64")


def cbor_uints(values: np.ndarray) -> tuple[bytes, np.ndarray]:
    """Canonical CBOR encodings of little-endian uint64 `values`, concatenated, and each one's end offset."""
    size_class = np.zeros(len(values), dtype=np.int8)
    for limit in _UINT_CLASS_LIMITS:
        size_class += values >= limit
    item_width = _UINT_CLASS_WIDTH[size_class]
    width = int(item_width.max()) if len(values) else 0
    # One row per value: head byte + big-endian argument, only as wide as the largest value needs.
    rows = np.empty((len(values), 1 + width), dtype=np.uint8)
    rows[:, 0] = np.where(size_class == 0, values, _UINT_CLASS_HEAD[size_class])
    if width:
        rows[:, 1:] = values.view(np.uint8).reshape(-1, 8)[:, width - 1 :: -1]  # low bytes, reversed
    # Then keep each row's head and its own argument bytes (the rightmost item_width), in order.
    keep_by_class = np.hstack(
        [np.ones((len(_UINT_CLASS_WIDTH), 1), bool), _UINT_CLASS_WIDTH[:, None] > np.arange(width)[::-1]]
    )
    keep = np.take(keep_by_class, size_class, axis=0)
    encoded = np.compress(keep.ravel(), rows.ravel()).tobytes()
    return encoded, np.cumsum(1 + item_width)


def _uint64_array(token_ids: Sequence[int]) -> np.ndarray | None:
    """The tokens as a little-endian uint64 array, or None if one is negative or >= 2**64."""
    try:
        packed = array.array("Q", token_ids)  # the fastest list -> machine ints conversion
    except OverflowError:
        return None
    if sys.byteorder == "big":
        packed.byteswap()
    return np.frombuffer(packed, dtype="<u8")


def _cbor_sha256(obj) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@functools.lru_cache(maxsize=16)  # a gateway has one seed: its CBOR and sha256 once, not per request
def cbor_seed_hash(seed: str) -> bytes:
    """vLLM's NONE_HASH: the chain's root is the hash of the seed *string*."""
    return _cbor_sha256(seed or "0")


# Tokens encoded per numpy call. Encoding a 128K-token prompt at once makes ~1 MB temporaries,
# above glibc's mmap threshold: each call then maps fresh pages and faults them in, which doubled
# the hashing time. Groups of this size keep every temporary below 128 KiB, reused from the heap.
_CBOR_TOKENS_PER_ENCODE = 8192


# Below this many tokens, joining cached per-token encodings beats numpy's fixed cost per call.
_SMALL_PROMPT_TOKENS = 2048


# Token id -> its canonical CBOR encoding, filled on first use. Bounded: a vocabulary has at most a
# few hundred thousand ids, but token ids come from clients. A plain dict read by one
# operator.itemgetter per chunk: the whole chunk's lookups happen in one C call, ~40% faster than
# map() over a lookup method, which costs a call per token (and a dict subclass with __missing__
# would lose most of that: every lookup then goes through the subclass).
_TOKEN_ENCODINGS: dict[int, bytes] = {}
_MAX_TOKEN_ENCODINGS = 1 << 20


def _joined_encodings(chunk: Sequence[int]) -> bytes:
    """The canonical CBOR encodings of a (non-empty) chunk's ids, concatenated. ValueError for an id
    outside 0..2**64-1."""
    try:
        found = operator.itemgetter(*chunk)(_TOKEN_ENCODINGS)
    except KeyError:  # an id seen for the first time: this chunk goes token by token, filling the cache
        if len(_TOKEN_ENCODINGS) + len(chunk) > _MAX_TOKEN_ENCODINGS:
            _TOKEN_ENCODINGS.clear()
        return b"".join([_token_encoding(token) for token in chunk])
    # itemgetter of a single item returns the item itself, not a 1-tuple.
    return found if len(chunk) == 1 else b"".join(found)


def _token_encoding(token: int) -> bytes:
    # A lookup that cannot miss: another thread may clear the cache between two reads.
    encoded = _TOKEN_ENCODINGS.get(token)
    if encoded is None:
        encoded = _TOKEN_ENCODINGS[token] = cbor_head(0, token)
    return encoded


def _hash_small_sha256_cbor(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool, seed: str, extras: BlockExtras | None
) -> list[BlockHash]:
    """hash_sha256_cbor for short prompts: each chunk's bytes are joined from cached per-token
    encodings, the same bytes cbor_uints makes. ValueError for an id outside 0..2**64-1."""
    full_list_head = cbor_head(4, chunk_size)
    parent = cbor_seed_hash(seed)
    tail, later_tail = _cbor_tails(extras)
    out = []
    for start, end in _chunk_bounds(len(token_ids), chunk_size, save_unfull_chunk):
        full = end - start == chunk_size
        digest = hashlib.sha256(_CBOR_TRIPLE_AND_BYTES32_HEAD)
        digest.update(parent)
        digest.update(full_list_head if full else cbor_head(4, end - start))
        digest.update(_joined_encodings(token_ids[start:end]))
        digest.update(tail)
        tail = later_tail
        parent = digest.digest()
        out.append(BlockHash(parent.hex(), end - start, full))
    return out


def hash_sha256_cbor(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0",
    extras: BlockExtras | None = None,
) -> list[BlockHash]:
    if len(token_ids) <= _SMALL_PROMPT_TOKENS:
        try:
            return _hash_small_sha256_cbor(token_ids, chunk_size, save_unfull_chunk, seed, extras)
        except ValueError:  # an id outside 0..2**64-1: cbor2 encodes any integer
            return hash_sha256_cbor_with_cbor2(token_ids, chunk_size, save_unfull_chunk, seed, extras)
    tokens = _uint64_array(token_ids)
    if tokens is None:
        return hash_sha256_cbor_with_cbor2(token_ids, chunk_size, save_unfull_chunk, seed, extras)
    full_list_head = cbor_head(4, chunk_size)
    parent = cbor_seed_hash(seed)
    tail, later_tail = _cbor_tails(extras)
    out = []
    for group in _chunk_groups(_chunk_bounds(len(tokens), chunk_size, save_unfull_chunk), chunk_size):
        first = group[0][0]
        encoded, item_ends = cbor_uints(tokens[first : group[-1][1]])
        view = memoryview(encoded)
        byte_ends = item_ends[[end - first - 1 for _, end in group]].tolist()
        byte_start = 0
        for (start, end), byte_end in zip(group, byte_ends, strict=True):
            full = end - start == chunk_size
            digest = hashlib.sha256(_CBOR_TRIPLE_AND_BYTES32_HEAD)
            digest.update(parent)
            digest.update(full_list_head if full else cbor_head(4, end - start))
            digest.update(view[byte_start:byte_end])
            digest.update(tail)
            tail = later_tail
            parent = digest.digest()
            out.append(BlockHash(parent.hex(), end - start, full))
            byte_start = byte_end
    return out


def _chunk_groups(bounds: Iterator[tuple[int, int]], chunk_size: int) -> Iterator[list[tuple[int, int]]]:
    """Consecutive chunk bounds, at least one and about _CBOR_TOKENS_PER_ENCODE tokens per group."""
    per_group = max(1, _CBOR_TOKENS_PER_ENCODE // chunk_size)
    group: list[tuple[int, int]] = []
    for chunk in bounds:
        group.append(chunk)
        if len(group) == per_group:
            yield group
            group = []
    if group:
        yield group


def hash_sha256_cbor_with_cbor2(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool, seed: str,
    extras: BlockExtras | None = None,
) -> list[BlockHash]:
    """The plain definition, cbor2 encoding every chunk: the fallback for ids the fast encoder does
    not cover (negative or >= 2**64), and the benchmark's baseline."""
    parent = cbor_seed_hash(seed)
    extras = extras or BlockExtras()
    out = []
    for start, end in _chunk_bounds(len(token_ids), chunk_size, save_unfull_chunk):
        parent = _cbor_sha256([parent, list(token_ids[start:end]), extras.keys(start == 0)])
        out.append(BlockHash(parent.hex(), end - start, end - start == chunk_size))
    return out


# --- sha256_hex (SGLang HiCache) and xxhash (iris) ----------------------------------------------


def sha256_hex_block(token_ids: Sequence[int], prior_hex: str | None) -> str:
    """SGLang HiCache's page hash: sha256(prior digest bytes || tokens as uint32 LE)."""
    digest = hashlib.sha256(bytes.fromhex(prior_hex) if prior_hex else b"")
    digest.update(_packed_le(token_ids, "I", "sha256_hex hashes tokens as uint32 (0..2**32-1)"))
    return digest.hexdigest()


def hash_sha256_hex(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0"
) -> list[BlockHash]:
    del seed  # SGLang's page chain has no seed
    view = memoryview(_packed_le(token_ids, "I", "sha256_hex hashes tokens as uint32 (0..2**32-1)"))
    prior = b""
    out = []
    for start, end in _chunk_bounds(len(token_ids), chunk_size, save_unfull_chunk):
        digest = hashlib.sha256(prior)
        digest.update(view[4 * start : 4 * end])
        prior = digest.digest()
        out.append(BlockHash(prior.hex(), end - start, end - start == chunk_size))
    return out


def hash_xxhash(
    token_ids: Sequence[int], chunk_size: int, save_unfull_chunk: bool = False, seed: str = "0"
) -> list[BlockHash]:
    del seed  # the iris stream is always seeded with 0
    view = memoryview(_packed_le(token_ids, "q", "xxhash hashes tokens as int64"))
    stream = xxhash.xxh64(seed=0)
    out = []
    for start, end in _chunk_bounds(len(token_ids), chunk_size, save_unfull_chunk):
        stream.update(view[8 * start : 8 * end])
        full = end - start == chunk_size
        if not full:
            # The partial chunk is padded with zero tokens so every key covers whole chunks.
            stream.update(bytes(8 * (chunk_size - (end - start))))
        out.append(BlockHash(str(stream.intdigest()), end - start, full))
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
    extras: BlockExtras | None = None,
) -> list[BlockHash]:
    """Chained block hashes of `token_ids`, one per chunk (the unfull last one only when saved).
    `extras` only with sha256_cbor (extras_hashable)."""
    if chunk_size < 1:
        raise ValueError("chunk_size must be at least 1")
    if extras:
        if not extras_hashable(algo):
            raise ValueError(f"{algo} block hashes carry no LoRA adapter or cache salt")
        return hash_sha256_cbor(token_ids, chunk_size, save_unfull_chunk, seed, extras)
    return _ALGORITHMS[HashAlgo(algo)](token_ids, chunk_size, save_unfull_chunk, seed)


def extras_hashable(algo: HashAlgo | str) -> bool:
    """Whether the algorithm's block hashes can mix in BlockExtras (vLLM's sha256_cbor can)."""
    return HashAlgo(algo) == HashAlgo.SHA256_CBOR
