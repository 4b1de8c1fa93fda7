"""The slice of the trace every target replays: its first requests, prompts cut to fit if asked.

Real engines on CPU serve a tiny model with a bounded context, while the trace's prompts run to 100K+
tokens. Cutting a prompt to its first N tokens keeps its leading trace blocks (the same hash ids), so
the reuse between requests stays what it was in that leading part; what is cut is the tail, which is
mostly each conversation's newest, unshared text. The slice is written as a Mooncake file, so the
replay and the hit ratio bound read exactly what the engines are sent.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import orjson

from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest, ideal_hit_ratio, read_trace


@dataclass(frozen=True)
class TraceSlice:
    path: Path  # the slice as a Mooncake JSON-lines file
    requests: tuple[TraceRequest, ...]
    ideal_hit_ratio: float  # one infinite cache shared by every engine, in the engines' blocks
    cut: int  # requests whose prompt was cut to max_prompt_tokens
    prompt_tokens: int  # after the cut


def cut_prompt(request: TraceRequest, max_prompt_tokens: int) -> TraceRequest:
    """The request with its prompt's first `max_prompt_tokens` tokens and the hash ids of their blocks."""
    if request.input_length <= max_prompt_tokens:
        return request
    blocks = -(-max_prompt_tokens // TRACE_BLOCK_TOKENS)
    return replace(request, input_length=max_prompt_tokens, hash_ids=request.hash_ids[:blocks])


def write_slice(trace: str, limit: int, max_prompt_tokens: int | None, engine_block_tokens: int,
                out_dir: Path) -> TraceSlice:
    """Read the first `limit` requests (TraceError if the trace is bad), cut them, write the slice."""
    if max_prompt_tokens is not None and max_prompt_tokens < 1:
        raise ValueError("max_prompt_tokens must be >= 1")
    requests = read_trace(trace, limit=limit)
    cut = tuple(cut_prompt(r, max_prompt_tokens) if max_prompt_tokens else r for r in requests)
    path = out_dir / "trace-slice.jsonl"
    with path.open("wb") as handle:
        for r in cut:
            # read_trace gave seconds; the file holds the Mooncake format's milliseconds.
            handle.write(orjson.dumps({"timestamp": r.arrival_s * 1000.0, "input_length": r.input_length,
                                       "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + b"\n")
    return TraceSlice(path, cut, ideal_hit_ratio(cut, engine_block_tokens=engine_block_tokens),
                      sum(a is not b for a, b in zip(requests, cut, strict=True)),
                      sum(r.input_length for r in cut))
