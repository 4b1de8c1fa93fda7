"""What `kvgate doctor` sends the engines: a probe completion, a probe chat, and a fresh token prompt."""

from __future__ import annotations

import random
import time

# Words, digits, punctuation, a newline and non-ASCII text: tokenizers differ on any of these.
PROBE_TEXT = (
    "kvgate doctor probe: the quick brown fox jumps over 13 lazy dogs.\n"
    "Zürich, 東京 and São Paulo -- 42% of 1,000 tokens?"
)
PROBE_TOOLS = [{
    "type": "function",
    "function": {
        "name": "lookup_city",
        "description": "Facts about a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}]
PROBE_CHAT = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": PROBE_TEXT},
    {"role": "assistant", "content": "A probe."},
    {"role": "user", "content": "Which cities were named?"},
]
# Token ids every tokenizer in use has (below any vocabulary's size, above the special tokens).
_TOKEN_RANGE = (1000, 30000)


def fresh_token_prompt(length: int) -> list[int]:
    """Token ids no engine has seen: the store must hold their blocks on the instance that computes
    them (the store records only the first writer of a key)."""
    rng = random.Random(time.time_ns())
    return [rng.randrange(*_TOKEN_RANGE) for _ in range(length)]
