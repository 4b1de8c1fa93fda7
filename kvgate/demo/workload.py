"""The demo's bundled workload: conversations about shared documents, growing turn by turn.

The shape of the traffic cache-aware routing exists for (RAG, assistants with long system
prompts, agents re-reading a file): a few long documents, each the start of many conversations,
more popular ones more often (Zipf); every conversation sends its whole history again at each
turn, so turn k+1's prompt extends turn k's. Where a request lands decides whether its
document and its history are already in that engine's KV cache.

Prompts are token ids (no tokenizer on the path), drawn from a seeded generator: the same
settings give the same requests in every run, on every machine.

Turns of one conversation are scheduled a think time apart (open loop, as a trace replay is):
the think time is longer than a turn takes, so a turn normally follows its predecessor's answer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvgate.bench.workload import DEFAULT_VOCABULARY, ReplayRequest


@dataclass(frozen=True)
class ConversationWorkload:
    num_requests: int = 200
    # Arrivals of new conversations are spread (Poisson) over this many seconds.
    duration_s: float = 15.0
    num_documents: int = 8
    document_tokens: tuple[int, int] = (2048, 6144)
    # Zipf exponent of document popularity: the k-th document is chosen with weight 1/k**skew.
    popularity_skew: float = 1.0
    turns: tuple[int, int] = (1, 4)
    user_tokens: tuple[int, int] = (64, 384)
    # The answer's length; the client keeps it in the history it sends with the next turn.
    output_tokens: tuple[int, int] = (16, 64)
    think_time_s: tuple[float, float] = (1.5, 4.0)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_documents < 1 or self.duration_s <= 0:
            raise ValueError("num_requests and num_documents must be >= 1, duration_s > 0")
        for name in ("document_tokens", "turns", "user_tokens", "output_tokens", "think_time_s"):
            low, high = getattr(self, name)
            if not 0 < low <= high:
                raise ValueError(f"{name}: expected 0 < low <= high, got {(low, high)}")


def conversation_requests(workload: ConversationWorkload) -> list[ReplayRequest]:
    """`num_requests` requests in send order; deterministic given the workload."""
    rng = random.Random(workload.seed)
    vocabulary = DEFAULT_VOCABULARY

    def tokens(bounds: tuple[int, int]) -> list[int]:
        return rng.choices(vocabulary, k=rng.randint(*bounds))

    documents = [tokens(workload.document_tokens) for _ in range(workload.num_documents)]
    popularity = [1 / (rank + 1) ** workload.popularity_skew for rank in range(workload.num_documents)]
    # Conversations arrive at a rate that fits the requests into the duration, on average.
    mean_turns = sum(workload.turns) / 2
    rate = workload.num_requests / mean_turns / workload.duration_s

    scheduled: list[tuple[float, list[int], int]] = []
    started_at = 0.0
    while len(scheduled) < workload.num_requests:
        started_at += rng.expovariate(rate)
        history = list(rng.choices(documents, weights=popularity)[0])
        send_at = started_at
        for _ in range(rng.randint(*workload.turns)):
            history += tokens(workload.user_tokens)
            answer = rng.randint(*workload.output_tokens)
            scheduled.append((send_at, list(history), answer))
            history += rng.choices(vocabulary, k=answer)
            send_at += rng.uniform(*workload.think_time_s)
    # Sorted by send time, then cut: the last conversations may lose their later turns.
    scheduled.sort(key=lambda item: item[0])
    return [
        ReplayRequest(index=i, send_at_s=at, prompt_token_ids=tuple(prompt), max_tokens=answer)
        for i, (at, prompt, answer) in enumerate(scheduled[: workload.num_requests])
    ]
