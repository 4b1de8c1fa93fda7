"""Prompt token ids -> the keys of the prompt's full blocks, exactly as the gateway computes them.

The engine caches only full blocks (as vLLM does), so the unfull tail is never hashed here, even
when the gateway saves unfull chunks: full blocks get the same keys either way.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config.settings import Settings
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.key_formats import make_key_format


class BlockKeyer:
    def __init__(self, settings: Settings) -> None:
        self._settings = settings
        self._format = make_key_format(settings)

    def keys(self, token_ids: Sequence[int]) -> tuple[str, ...]:
        s = self._settings
        blocks = hash_blocks(
            s.kvs_hash_algo, token_ids, s.kvs_chunk_size, save_unfull_chunk=False, seed=s.hash_seed
        )
        return tuple(self._format.keys(blocks))
