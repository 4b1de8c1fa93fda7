"""Mooncake-format traces: one JSON object per line, each hash id one 512-token block.

`{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}` (REFERENCE.md
section 10). Equal hash ids mean an equal prefix up to and including that block, so a hash id
already names the whole prefix and serves as a block key as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import orjson

from kvgate.engine_model import BlockCache

TRACE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int
    arrival_s: float
    input_length: int
    output_length: int
    # One key per block, the last one covering the remainder of the prompt.
    block_keys: tuple[str, ...]

    @property
    def full_block_keys(self) -> tuple[str, ...]:
        """Keys of the blocks an engine can cache (the partial last block is not)."""
        return self.block_keys[: self.input_length // TRACE_BLOCK_TOKENS]


def read_trace(path: str | Path, *, limit: int | None = None, time_scale: float = 1.0) -> list[TraceRequest]:
    """Parse a trace; arrival times are the timestamps in seconds multiplied by `time_scale`."""
    if time_scale <= 0:
        raise TraceError("time scale must be > 0")
    requests: list[TraceRequest] = []
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            if limit is not None and len(requests) >= limit:
                break
            if not line.strip():
                continue
            requests.append(_parse_line(line, line_no, len(requests), time_scale))
    if any(b.arrival_s < a.arrival_s for a, b in zip(requests, requests[1:], strict=False)):
        requests.sort(key=lambda r: r.arrival_s)
        requests = [_renumbered(r, i) for i, r in enumerate(requests)]
    return requests


def _parse_line(line: bytes, line_no: int, index: int, time_scale: float) -> TraceRequest:
    try:
        obj = orjson.loads(line)
        timestamp = float(obj["timestamp"])
        input_length = int(obj["input_length"])
        output_length = int(obj["output_length"])
        hash_ids = obj["hash_ids"]
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
        raise TraceError(f"trace line {line_no}: {exc}") from None
    if input_length < 1 or timestamp < 0:
        raise TraceError(f"trace line {line_no}: input_length must be >= 1 and timestamp >= 0")
    if len(hash_ids) != -(-input_length // TRACE_BLOCK_TOKENS):
        raise TraceError(
            f"trace line {line_no}: {len(hash_ids)} hash ids for {input_length} tokens "
            f"(expected one per {TRACE_BLOCK_TOKENS}-token block)"
        )
    return TraceRequest(
        index=index,
        arrival_s=timestamp / 1000.0 * time_scale,
        input_length=input_length,
        # Every request yields at least its first token.
        output_length=max(1, output_length),
        block_keys=tuple(str(h) for h in hash_ids),
    )


def _renumbered(req: TraceRequest, index: int) -> TraceRequest:
    return TraceRequest(index, req.arrival_s, req.input_length, req.output_length, req.block_keys)


def ideal_hit_ratio(requests: Iterable[TraceRequest]) -> float:
    """Token-weighted hit ratio of one infinite cache shared by every instance.

    Same rules as the engines (a prompt's leading full blocks that any earlier request computed,
    at most prompt - 1 tokens), but no capacity limit and no placement: the bound routing chases.
    """
    seen: set[str] = set()
    hits = total = 0
    for req in requests:
        keys = req.full_block_keys
        matched = 0
        for key in keys:
            if key not in seen:
                break
            matched += 1
        hits += min(matched * TRACE_BLOCK_TOKENS, req.input_length - 1)
        total += req.input_length
        seen.update(keys)
    return hits / total if total else 0.0


def fleet_lru_hit_ratio(requests: Iterable[TraceRequest], capacity_blocks: int) -> float:
    """The same with one LRU cache as large as the whole fleet's: what capacity alone allows.

    A reference, not a bound: it ignores the memory running requests hold, and instances that
    duplicate hot blocks have less room than this, instances that partition well may do better.
    """
    cache = BlockCache(capacity_blocks)
    hits = total = 0
    for req in requests:
        keys = req.full_block_keys
        hits += min(cache.match_prefix(keys) * TRACE_BLOCK_TOKENS, req.input_length - 1)
        total += req.input_length
        cache.insert(keys)
    return hits / total if total else 0.0
