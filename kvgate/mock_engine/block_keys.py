"""Prompt token ids -> the keys of the prompt's full blocks, exactly as the gateway computes them.

The engine caches only full blocks (as vLLM does), so the unfull tail is never hashed here, even
when the gateway saves unfull chunks: full blocks get the same keys either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config.settings import HashAlgo, Settings
from kvgate.scheduler.hashing import BlockHash, hash_blocks
from kvgate.scheduler.key_formats import make_key_format


class BlockKeyer:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._format = make_key_format(settings)

    def keys(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        return tuple(self._format.keys(self._blocks(self._settings.kvs_hash_algo, token_ids)))

    def keys_and_vllm_hashes(self, token_ids: Sequence[int]) -> tuple[tuple[str, ...], list[bytes]]:
        """The keys, and vLLM's own 32-byte hash of each block (sha256_cbor from the hash seed,
        as vLLM's KV events name blocks), whatever algorithm the store keys use."""
        algo = self._settings.kvs_hash_algo
        blocks = self._blocks(algo, token_ids)
        vllm = blocks if algo == HashAlgo.SHA256_CBOR else self._blocks(HashAlgo.SHA256_CBOR, token_ids)
        return tuple(self._format.keys(blocks)), [bytes.fromhex(block.value) for block in vllm]

    def _blocks(self, algo: HashAlgo, token_ids: Sequence[int]) -> list[BlockHash]:
        s = self._settings
        return hash_blocks(algo, token_ids, s.kvs_chunk_size, save_unfull_chunk=False, seed=s.hash_seed)
