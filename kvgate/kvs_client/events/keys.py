"""vLLM's block hashes as the events index keys them, and kvgate's prompt blocks as the same keys.

vLLM's block hash with `--prefix-caching-hash-algo sha256_cbor` is the 32-byte digest kvgate's
sha256_cbor hashing computes (scheduler/hashing.py, same seed: vLLM reads PYTHONHASHSEED, and
without it uses the seed string "vllm-none-hash"). Its events carry either the digest's low 64 bits
as an int (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`, the default) or the digest itself; the index
keys both as that int, so engines of either setting match the same prompt blocks.

`engine_block_hashes` is the API for anything that must publish or check what an engine would
(mock engines, tests against real engines).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvgate.scheduler.hashing import BlockExtras, BlockHash, hash_sha256_cbor

MASK64 = (1 << 64) - 1
# The index marks free slots with 0, so a block whose key is 0 is stored under this one instead
# (a 2**-64 chance of confusing two blocks, the same as any two 64-bit keys).
_ZERO_KEY = MASK64


def key_of(block_hash: int | bytes) -> int:
    """The index key of a hash as an event carries it (int, or the raw digest bytes)."""
    if isinstance(block_hash, bytes):
        value = int.from_bytes(block_hash, "big") & MASK64
    else:
        value = block_hash & MASK64
    return value or _ZERO_KEY


def prompt_keys(blocks: Sequence[BlockHash]) -> np.ndarray:
    """Index keys of a prompt's full blocks (sha256_cbor hex digests), as uint64; a saved unfull
    last block is left out: engines only store full blocks."""
    # One hex decode for the whole prompt: an int() per block cost ~0.3 us each on the request path.
    low_halves = bytes.fromhex("".join([block.value[-16:] for block in blocks if block.full]))
    keys = np.frombuffer(low_halves, dtype=">u8").astype(np.uint64)
    keys[keys == 0] = _ZERO_KEY
    return keys


def engine_block_hashes(
    token_ids: Sequence[int], block_size: int, seed: str = "0", as_bytes: bool = False,
    extras: BlockExtras | None = None,
) -> list[int] | list[bytes]:
    """What a vLLM engine (sha256_cbor, PYTHONHASHSEED=`seed`, `--block-size block_size`) publishes
    in BlockStored.block_hashes for these prompt tokens (of a request with `extras`: its LoRA
    adapter, its cache salt), block by block: the low 64 bits of each digest as an int, or with
    `as_bytes` (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0) the 32-byte digest."""
    blocks = hash_sha256_cbor(token_ids, block_size, False, seed, extras)
    digests = [bytes.fromhex(block.value) for block in blocks]
    if as_bytes:
        return digests
    return [int.from_bytes(digest, "big") & MASK64 for digest in digests]
