"""How long an engine step takes: the service profile of one simulated GPU.

Defaults resemble a 7-8B dense model (Llama-3-8B shape: 32 layers, 8 KV heads of 128, bf16) on one
80 GB GPU:

- prefill of n new tokens after `c` cached ones costs `n * (per_token_s + per_token_pair_s * (n + 2c))`.
  The pair term is attention: it makes chunked prefill of a prompt cost the same as prefilling it
  at once (the chunks' terms sum to L^2) and makes long prompts super-linear. With a 6 ms step
  overhead: 1K tokens ~38 ms, 8K ~0.35 s, 32K ~2.6 s.
- a decode step costs `per_sequence_s` per running sequence plus `per_context_token_s` per token of
  context read (the KV cache streamed from HBM: 128 KiB/token at ~3 TB/s is ~4e-8 s).
- KV memory: ~56 GB left after weights at 0.9 utilisation / 128 KiB per token ~ 426K tokens,
  i.e. 1664 blocks of 256 tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.scheduler.prefill_curve import PrefillCurve


@dataclass(frozen=True, slots=True)
class QuadraticPrefillCost:
    """Fitted prefill curve: linear (MLP, projections) plus attention over the whole context."""

    per_token_s: float = 2.93e-5
    per_token_pair_s: float = 1.53e-9

    def chunk_s(self, cached_tokens: int, new_tokens: int) -> float:
        return new_tokens * (self.per_token_s + self.per_token_pair_s * (new_tokens + 2 * cached_tokens))


# Measured prefill curve: (prompt_tokens, seconds of compute from scratch); the TTFT model's own.
TablePrefillCost = PrefillCurve


@dataclass(frozen=True, slots=True)
class DecodeCost:
    """Per-step decode cost on top of the step overhead."""

    per_sequence_s: float = 6e-5
    per_context_token_s: float = 4e-8

    def step_s(self, num_sequences: int, context_tokens: int) -> float:
        return self.per_sequence_s * num_sequences + self.per_context_token_s * context_tokens


PrefillCost = QuadraticPrefillCost | TablePrefillCost


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """Everything that decides an engine's timing and capacity. `time_scale` is the mock engine's."""

    block_size: int = 256
    cache_capacity_blocks: int = 1664
    # Chunked-prefill token budget of one step (decode tokens count against it too).
    max_batch_tokens: int = 2048
    max_running_requests: int = 256
    # Every prefilling request first gets up to this many tokens of a step's budget, the rest goes
    # in arrival order: a short prompt is not stuck behind a long one's chunks.
    prefill_share_tokens: int = 256
    step_overhead_s: float = 0.006
    prefill: PrefillCost = QuadraticPrefillCost()
    decode: DecodeCost = DecodeCost()

    def __post_init__(self) -> None:
        for name in ("block_size", "cache_capacity_blocks", "max_batch_tokens", "max_running_requests"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefill_share_tokens < 0 or self.step_overhead_s < 0:
            raise ValueError("prefill_share_tokens and step_overhead_s must be >= 0")

    @classmethod
    def from_table(
        cls,
        prefill_points: Sequence[tuple[int, float]],
        *,
        step_overhead_s: float = 0.006,
        **fields,
    ) -> ServiceProfile:
        """A profile from measured whole-prompt prefill times on an idle engine, (tokens, seconds).

        The step overhead is subtracted from each measurement so a one-step prefill reproduces it.
        """
        points = tuple((int(n), max(0.0, float(s) - step_overhead_s)) for n, s in prefill_points)
        return cls(prefill=TablePrefillCost(points), step_overhead_s=step_overhead_s, **fields)

    def with_block_size(self, block_size: int) -> ServiceProfile:
        """The same GPU with another block size: the cache keeps its capacity in tokens."""
        tokens = self.cache_capacity_blocks * self.block_size
        return dataclasses.replace(
            self, block_size=block_size, cache_capacity_blocks=max(1, tokens // block_size)
        )
