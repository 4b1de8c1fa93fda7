"""A prompt encoded segment by segment only as far as routing needs, and its estimated length.

Routing needs exact ids only up to the first block no instance holds: later blocks can never be
prefix hits, so for them only the prompt's token count matters (the same uncached tail on every
instance). A PromptEncoding holds the exact leading ids of the segments encoded so far (segments
are never cut: the tokenizer's segmenter guarantees that ids are exact at segment boundaries) and
an estimate of the whole prompt's length; the tokenizer service grows it (`TokenizerService.extend`)
or finishes it in the background.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

# A byte-level tokenizer (BPE over bytes, SentencePiece with byte fallback) never makes more tokens
# than the text has UTF-8 bytes, and a UTF-8 character is at most 4 bytes: an upper bound of any
# text's token count that costs nothing to compute.
MAX_BYTES_PER_CHAR = 4
# An estimate at most 1/ESTIMATE_MARGIN of the length limit is trusted not to pass it (may_exceed).
ESTIMATE_MARGIN = 2
# Before any of a text is encoded, its first window is sized at prose's ratio (about 4).
PROSE_CHARS_PER_TOKEN = 4.0


@dataclass(slots=True, eq=False)
class PromptEncoding:
    """`segments[:encoded_segments]` are encoded into `ids` (after the special-token prefix);
    the special-token suffix is appended once every segment is."""

    text: str
    segments: Sequence[str]
    suffix_ids: Sequence[int]
    ids: list[int]
    # The special-token prefix's length: those ids carry no characters of the text.
    prefix_tokens: int
    encoded_segments: int = 0
    encoded_chars: int = 0

    @classmethod
    def exact(cls, ids: list[int]) -> PromptEncoding:
        """Ids known in full (a token-id prompt, or a text encoded whole)."""
        return cls("", (), (), ids, 0)

    @property
    def complete(self) -> bool:
        return self.encoded_segments >= len(self.segments)

    def add(self, parts: Sequence[array]) -> None:
        """The ids of the next `len(parts)` segments (at least one)."""
        for part in parts:
            self.ids.extend(part)
            self.encoded_chars += len(self.segments[self.encoded_segments])
            self.encoded_segments += 1
        if self.complete:  # just now: the last segment was among `parts`
            self.ids.extend(self.suffix_ids)

    @property
    def remaining_chars(self) -> int:
        return len(self.text) - self.encoded_chars

    @property
    def chars_per_token(self) -> float:
        """Of the text encoded so far (special tokens left out)."""
        text_tokens = len(self.ids) - self.prefix_tokens
        if self.encoded_chars == 0 or text_tokens <= 0:
            return PROSE_CHARS_PER_TOKEN
        return self.encoded_chars / text_tokens

    @property
    def total_tokens(self) -> int:
        """The prompt's length: exact once complete, else an estimate.

        Estimator: the exact ids so far, plus the characters not yet encoded at the exact part's own
        characters-per-token ratio, plus the special-token suffix. It never falls below the exact
        part, so a predicted hit (made of exact blocks) never exceeds it. A conversation's turns
        keep one style of text, so the ratio of its leading segments (at least a window of
        2 store chunks) predicts the rest within a few percent; a text that changes script
        midway (prose, then CJK or code) can be off by more, which moves only load estimates.
        """
        if self.complete:
            return len(self.ids)
        return len(self.ids) + round(self.remaining_chars / self.chars_per_token) + len(self.suffix_ids)

    def may_exceed(self, max_tokens: int) -> bool:
        """Whether the whole prompt could have more than `max_tokens` tokens. No when the estimate
        is within half the limit (it would have to be off by 2x: a text whose rest changes script,
        say from prose to CJK; and then the engine refuses the prompt itself, so only the
        gateway's early refusal is lost) or when the byte bound is within it: the exact ids so
        far plus one token per UTF-8 byte of the rest, plus the suffix."""
        if self.complete:
            return len(self.ids) > max_tokens
        if self.total_tokens * ESTIMATE_MARGIN <= max_tokens:
            return False
        fixed = len(self.ids) + len(self.suffix_ids)
        if fixed + self.remaining_chars * MAX_BYTES_PER_CHAR <= max_tokens:
            return False  # cheap: no need to measure the rest's bytes
        rest = self.text[self.encoded_chars:].encode("utf-8", "surrogatepass")
        return fixed + len(rest) > max_tokens
