"""The words a mock engine "generates": deterministic given the engine seed and the prompt.

Each output token is one pseudo-word, so a token count is a word count, and the same prompt sent
to any engine with the same seed yields the same text (tests and replays can compare).
"""

from __future__ import annotations

import random
import struct
from collections.abc import Sequence

import xxhash

# Pronounceable pseudo-words of one to three consonant-vowel syllables: no word list to ship.
_SYLLABLES = tuple(c + v for c in "bdfgklmnprstvz" for v in "aeiou")
# Generated token ids are drawn below this (a 32K vocabulary's worth).
_TOKEN_ID_RANGE = 32_000


def generated_words(seed: int, prompt_token_ids: Sequence[int], count: int) -> list[str]:
    """`count` words, each with its leading space, drawn from an RNG seeded by seed and prompt."""
    digest = xxhash.xxh64(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), seed=seed)
    rng = random.Random(digest.intdigest())
    return [" " + "".join(rng.choices(_SYLLABLES, k=rng.randint(1, 3))) for _ in range(count)]


def generated_token_ids(seed: int, prompt_token_ids: Sequence[int], count: int) -> list[int]:
    """The ids of the first `count` generated tokens, deterministic as the words are. Only the KV
    blocks they fill use them (vLLM names such a block by its tokens); the text stays the words."""
    digest = xxhash.xxh64(struct.pack(f"<{len(prompt_token_ids)}q", *prompt_token_ids), seed=seed)
    rng = random.Random(~digest.intdigest())
    return [rng.randrange(_TOKEN_ID_RANGE) for _ in range(count)]
