"""A Mooncake-format trace -> deterministic prompts, ready to replay against a live endpoint.

Each line of a trace is `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`;
each hash id stands for one 512-token block and equal ids mean a shared prefix (REFERENCE.md section
10). The trace carries no text, so every hash id is turned into a block of token ids drawn from a
random generator seeded by the id: the same id always gives the same block, in any run, on any
machine, so two requests that share hash ids share a token prefix exactly as in the original trace
and the engines' prefix caches see the trace's real reuse.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512
# Ids at the bottom of a vocabulary are usually special tokens (BOS, EOS, padding); 32,000 is
# below the vocabulary size of every common model, so any engine would accept these ids.
# A vocabulary is a range or a tuple: hashable, so generated blocks can be cached per vocabulary.
Vocabulary = range | tuple[int, ...]
DEFAULT_VOCABULARY: Vocabulary = range(1000, 32000)


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ReplayRequest:
    """One request of a replay: when to send it (seconds after the start) and what to send."""

    index: int
    send_at_s: float
    prompt_token_ids: tuple[int, ...]
    max_tokens: int


def _parse_record(line: str, where: str) -> TraceRecord:
    try:
        raw = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(raw, dict):
        raise TraceError(f"{where}: expected a JSON object")
    try:
        timestamp = float(raw["timestamp"])
        input_length = int(raw["input_length"])
        output_length = int(raw["output_length"])
        hash_ids = tuple(int(h) for h in raw["hash_ids"])
    except KeyError as exc:
        raise TraceError(f"{where}: missing field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise TraceError(f"{where}: bad value: {exc}") from None
    if input_length < 1 or output_length < 0 or timestamp < 0:
        raise TraceError(f"{where}: timestamp and output_length must be >= 0, input_length >= 1")
    if any(h < 0 for h in hash_ids):
        raise TraceError(f"{where}: hash ids must be >= 0")
    if input_length > BLOCK_TOKENS * len(hash_ids):
        raise TraceError(
            f"{where}: input_length {input_length} needs {-(-input_length // BLOCK_TOKENS)} blocks "
            f"of {BLOCK_TOKENS} tokens but hash_ids has {len(hash_ids)}"
        )
    return TraceRecord(timestamp, input_length, output_length, hash_ids)


def read_trace(
    path: str | Path, *, limit: int | None = None, duration_s: float | None = None
) -> list[TraceRecord]:
    """The first `limit` records, or those within `duration_s` of the first one (trace time)."""
    records: list[TraceRecord] = []
    try:
        handle = open(path, encoding="utf-8")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise TraceError(f"trace {str(path)!r}: cannot read: {exc.strerror}") from None
    with handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            if limit is not None and len(records) >= limit:
                break
            record = _parse_record(line, f"{path}:{number}")
            if duration_s is not None and records and (
                record.timestamp_ms - records[0].timestamp_ms > duration_s * 1000
            ):
                break
            records.append(record)
    if not records:
        raise TraceError(f"trace {str(path)!r}: no records")
    return records


def ideal_hit_ratio(records: Sequence[TraceRecord]) -> float:
    """The hit ratio one infinite cache shared by every engine would give: each request's leading
    hash ids seen in any earlier request, in whole blocks, over all prompt tokens. No router can beat it."""
    seen: set[int] = set()
    hit = total = 0
    for record in records:
        reused = 0
        for hash_id in record.hash_ids:
            if hash_id not in seen:
                break
            reused += 1
        hit += min(reused * BLOCK_TOKENS, record.input_length)
        total += record.input_length
        seen.update(record.hash_ids)
    return hit / total if total else 0.0


@lru_cache(maxsize=65536)
def block_tokens(hash_id: int, vocabulary: Vocabulary = DEFAULT_VOCABULARY) -> tuple[int, ...]:
    """The 512 token ids standing for `hash_id`; a pure function of the id and the vocabulary."""
    # random.Random seeded with an int is reproducible across runs and Python versions.
    rng = random.Random(hash_id)
    return tuple(rng.choices(vocabulary, k=BLOCK_TOKENS))


def prompt_token_ids(record: TraceRecord, vocabulary: Vocabulary = DEFAULT_VOCABULARY) -> tuple[int, ...]:
    """The record's blocks end to end, cut to `input_length` (only the last block is ever cut)."""
    needed = -(-record.input_length // BLOCK_TOKENS)
    tokens: list[int] = []
    for hash_id in record.hash_ids[:needed]:
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

    def prompt(self, record: TraceRecord) -> str:
        needed = -(-record.input_length // BLOCK_TOKENS)
        pieces: list[str] = []
        for hash_id in record.hash_ids[:needed]:
            pieces.extend(self.block_pieces(hash_id))
        return "".join(pieces[: record.input_length])


@lru_cache(maxsize=65536)
def _block_pieces(hash_id: int, words: tuple[str, ...]) -> tuple[str, ...]:
    chosen = random.Random(hash_id).choices(words, k=BLOCK_TOKENS - 1)
    return (chosen[0], *(" " + w for w in chosen[1:]), "\n")


def build_requests(
    records: Iterable[TraceRecord],
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
    start_ms = records[0].timestamp_ms
    requests = []
    for index, record in enumerate(records):
        max_tokens = max(1, record.output_length)
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        requests.append(
            ReplayRequest(
                index=index,
                send_at_s=max(0.0, record.timestamp_ms - start_ms) / 1000.0 / speedup,
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
