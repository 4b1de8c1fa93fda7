"""Trace requests -> deterministic prompts, ready to replay against a live endpoint.

A trace (read by `kvgate.simulator.trace.read_trace`) carries no text, only one hash id per 512-token
block, equal ids meaning a shared prefix. Every hash id is turned into a block of token ids drawn
from a random generator seeded by the id: the same id always gives the same block, in any run, on
any machine, so two requests that share hash ids share a token prefix exactly as in the original
trace and the engines' prefix caches see the trace's real reuse.
"""

from __future__ import annotations

import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest

# Ids at the bottom of a vocabulary are usually special tokens (BOS, EOS, padding); 32,000 is
# below the vocabulary size of every common model, so any engine would accept these ids.
# A vocabulary is a range or a tuple: hashable, so generated blocks can be cached per vocabulary.
Vocabulary = range | tuple[int, ...]
DEFAULT_VOCABULARY: Vocabulary = range(1000, 32000)


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replay: when to send it (seconds after the start) and what to send."""

    index: int
    send_at_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, vocabulary: Vocabulary = DEFAULT_VOCABULARY) -> tuple[int, ...]:
    """The 512 token ids standing for `hash_id`; a pure function of the id and the vocabulary."""
    # random.Random seeded with an int is reproducible across runs and Python versions.
    rng = random.Random(hash_id)
    return tuple(rng.choices(vocabulary, k=TRACE_BLOCK_TOKENS))


def prompt_token_ids(record: TraceRequest, vocabulary: Vocabulary = DEFAULT_VOCABULARY) -> tuple[int, ...]:
    """The record's blocks end to end, cut to `input_length` (only the last block is ever cut)."""
    tokens: list[int] = []
    for hash_id in record.hash_ids:
        tokens.extend(block_tokens(hash_id, vocabulary))
    return tuple(tokens[: record.input_length])


@dataclass(frozen=True)
class TextRendering:
    """Prompts as text for endpoints that take only text (sglang-router refuses token-id prompts).

    Each token becomes one word that the engines' tokenizer encodes as exactly one token, so a
    rendered prompt has the trace's length, and a block ends in a newline, a boundary where the
    tokenizer starts afresh: a block's text always encodes to the same ids, whatever came before,
    so equal hash ids still mean an equal token prefix on the engine.
    """

    words: tuple[str, ...]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any) -> TextRendering:
        """Lowercase words that are one token both alone and after a space, in vocabulary order."""
        vocabulary = tokenizer.get_vocab()
        words = []
        for token in sorted(vocabulary, key=vocabulary.__getitem__):
            word = tokenizer.convert_tokens_to_string([token])
            if word.startswith(" ") and word[1:].isascii() and word[1:].isalpha() and word[1:].islower():
                word = word[1:]
                if all(len(tokenizer.encode(w, add_special_tokens=False)) == 1 for w in (word, " " + word)):
                    words.append(word)
        if len(words) < 256:
            raise ValueError(f"the tokenizer has only {len(words)} single-token words; cannot render text")
        return cls(tuple(words))

    def block_pieces(self, hash_id: int) -> tuple[str, ...]:
        """512 pieces, one per token: a bare word, 510 space-led words, a newline."""
        return _block_pieces(hash_id, self.words)

    def prompt(self, record: TraceRequest) -> str:
        pieces: list[str] = []
        for hash_id in record.hash_ids:
            pieces.extend(self.block_pieces(hash_id))
        return "".join(pieces[: record.input_length])


@lru_cache(maxsize=65536)
def _block_pieces(hash_id: int, words: tuple[str, ...]) -> tuple[str, ...]:
    chosen = random.Random(hash_id).choices(words, k=TRACE_BLOCK_TOKENS - 1)
    return (chosen[0], *(" " + w for w in chosen[1:]), "\n")


def build_requests(
    records: Iterable[TraceRequest],
    *,
    speedup: float = 1.0,
    max_tokens_cap: int | None = None,
    vocabulary: Vocabulary = DEFAULT_VOCABULARY,
) -> list[ReplayRequest]:
    """Schedule the records `speedup` times faster than recorded, starting at 0 s."""
    if speedup <= 0:
        raise ValueError("speedup must be > 0")
    records = list(records)
    if not records:
        return []
    start_s = records[0].arrival_s
    requests = []
    for index, record in enumerate(records):
        max_tokens = max(1, record.output_length)
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        requests.append(
            ReplayRequest(
                index=index,
                send_at_s=max(0.0, record.arrival_s - start_s) / speedup,
                prompt_token_ids=prompt_token_ids(record, vocabulary),
                max_tokens=max_tokens,
            )
        )
    return requests


def completion_body(request: ReplayRequest, model: str, prompt: str | Sequence[int] | None = None) -> dict[str, Any]:
    """A streaming /v1/completions body; the usage chunk at the end carries the cached-token count.

    `prompt` overrides the token ids (e.g. with their text rendering for routers that only take text).
    """
    return {
        "model": model,
        "prompt": list(request.prompt_token_ids) if prompt is None else prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
