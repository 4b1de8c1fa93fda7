"""What an engine's KV events say, in kvgate's own words, and the one job of a decoder.

Engines publish what their prefix cache gains and loses (vLLM: BlockStored, BlockRemoved,
AllBlocksCleared, in msgpack). A decoder turns one message's payload into an `EventBatch` of the
types below and knows every field name of its engine's protocol; nothing outside its module does.
The index (index.py) and the subscriber (subscriber.py) work on these types alone, so a second
engine's format is one more module, one `KVEventsFormat` value and one registration (`__init__.py`).

Block hashes are kept as 64-bit ints: vLLM publishes either the low 64 bits of its 32-byte block
digest (the default) or the whole digest; both come out as the same int (keys.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol


class Medium(IntEnum):
    """Where in an engine a block sits, cheapest first; the index keeps one bit per instance per medium."""

    GPU = 0  # the engine's own prefix cache: reused for free
    CPU = 1  # the engine's CPU offload tier: loaded over the host link
    DISK = 2  # the engine's storage tier: loaded at disk bandwidth


class MalformedEvents(ValueError):
    """A payload that is not a batch of this format's events. `reason` labels the drop metric."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class BlocksStored:
    """Blocks the engine added, in prefix order: each one's parent is the one before it, the first
    one's is `parent` (None: the prefix starts here)."""

    hashes: tuple[int, ...]
    parent: int | None
    medium: Medium
    block_size: int
    # Blocks whose hash covers more than tokens, a LoRA adapter and a cache salt (images, prompt
    # embeddings): kvgate cannot compute such hashes from a prompt, so they never match one; counted.
    keyed_beyond_tokens: bool = False


@dataclass(frozen=True, slots=True)
class BlocksRemoved:
    hashes: tuple[int, ...]
    medium: Medium


@dataclass(frozen=True, slots=True)
class AllCleared:
    """The engine dropped its whole prefix cache (every medium)."""


Event = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True, slots=True)
class EventBatch:
    timestamp: float  # the engine's wall clock (seconds since the epoch) when it published the batch
    events: tuple[Event, ...]
    # Events of this batch the index has no use for (other KV cache groups, unknown types), counted.
    ignored: int = 0


class EventDecoder(Protocol):
    """One engine's wire format. Why an interface: the subscriber, the index and their failure
    handling (gaps, restarts, replay) are the same for every engine; only the payload differs."""

    def decode(self, payload: bytes) -> EventBatch:
        """The batch in `payload`, or MalformedEvents when any part of it is unreadable: applying
        the rest would leave the index wrong about the part skipped, so the caller drops it whole."""
        ...
