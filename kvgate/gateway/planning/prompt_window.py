"""How much of a text prompt the planner tokenizes before routing (--tokenize-tail).

A prompt's blocks after the first one no instance holds can never be prefix hits, on any instance
or tier; for them routing needs only the prompt's length. With `estimate`, the planner tokenizes a
window past the cached segments (two store chunks of new text), hashes its full blocks and asks
the store. While the store holds the last block asked (another worker or replica tokenized more of
this prompt, or engines computed it), the window doubles and the store is asked again. The decision
reads the estimated length (prompt_encoding.py); afterwards the rest of the text is tokenized in
the background so the tokenize cache learns it for the conversation's next turn.

Exactness stays where something reads every id: `--forward-token-ids` (the engine gets the ids),
prompts that could be over the length limit (PromptEncoding.may_exceed), and token-id prompts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.config.settings import Settings, TokenizeTail
from kvgate.gateway.planning.prompt_encoding import PromptEncoding
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.gateway.protocol import ParsedRequest
from kvgate.kvs_client.base import KVSLookup
from kvgate.metrics.definitions import TokenizeTailMetrics

# The first window, in store chunks of new text past the cached segments: one chunk would do
# for the block the store misses, a second absorbs a characters-per-token guess that is off.
WINDOW_CHUNKS = 2


@dataclass(frozen=True)
class PromptWindow:
    mode: TokenizeTail
    chunk_tokens: int
    forward_token_ids: bool
    metrics: TokenizeTailMetrics

    @classmethod
    def from_settings(cls, settings: Settings, metrics: TokenizeTailMetrics) -> PromptWindow:
        return cls(settings.tokenize_tail, settings.kvs_chunk_size, settings.forward_token_ids, metrics)

    def first_window(self, request: ParsedRequest) -> int | None:
        """Tokens of new text to tokenize before the first lookup; None: the whole prompt."""
        if self.mode == TokenizeTail.EXACT:
            return None
        if self.forward_token_ids and request.prompt_text is not None and request.batch is None:
            return None  # these ids are sent to the engine (forwarder.py): all of them, exactly
        return WINDOW_CHUNKS * self.chunk_tokens

    def hashable_ids(self, encoding: PromptEncoding) -> Sequence[int]:
        """The ids to hash: all of a complete prompt; the full blocks only of a partial one (its
        last, unfull block is not the engine's block)."""
        if encoding.complete:
            return encoding.ids
        return encoding.ids[: len(encoding.ids) - len(encoding.ids) % self.chunk_tokens]

    @staticmethod
    def should_extend(encoding: PromptEncoding, keys: Sequence[str], lookup: KVSLookup | None,
                      max_query_blocks: int) -> bool:
        """Whether routing could gain from more exact ids: the prompt is partial and either no
        full block is tokenized yet or the store holds the last block asked, on any tier (blocks
        past it may be hits too)."""
        if encoding.complete:
            return False
        if not keys:
            return True
        if lookup is None or lookup.status != "ok" or len(keys) >= max_query_blocks:
            return False
        return bool(lookup.locations[-1] or (lookup.disk_locations and lookup.disk_locations[-1]))

    def complete_later(self, tokenizer: TokenizerService, encoding: PromptEncoding) -> None:
        """Hand the rest of a routed prompt to the background tokenizer (or count it dropped)."""
        outcome = self.metrics.background.labels
        if not tokenizer.complete_in_background(encoding, lambda result: outcome(result).inc()):
            outcome("dropped").inc()
