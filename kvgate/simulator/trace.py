"""Mooncake-format traces: the one reader and the hit-ratio references every replay uses.

Each line is `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`
(REFERENCE.md section 10), one hash id per 512-token block, the last one covering the remainder
of the prompt. Equal hash ids mean an equal prefix up to and including that block, so a hash id
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
    """A trace that cannot be replayed; the message names the file and, for a bad line, the line."""


@dataclass(frozen=True, slots=True)
class TraceRequest:
    index: int  # position in arrival order
    arrival_s: float  # the recorded timestamp in seconds, times the reader's time_scale
    input_length: int
    output_length: int  # as recorded, possibly 0: callers ask for at least one token
    hash_ids: tuple[int, ...]  # exactly one per 512-token block (reader-checked)

    @property
    def block_keys(self) -> tuple[str, ...]:
        """The hash ids as the string keys caches and the scheduler take, the partial last one included."""
        return tuple(map(str, self.hash_ids))

    @property
    def full_block_keys(self) -> tuple[str, ...]:
        """Keys of the blocks an engine with 512-token blocks can cache (not the partial last one)."""
        return tuple(map(str, self.hash_ids[: self.input_length // TRACE_BLOCK_TOKENS]))


def read_trace(
    path: str | Path, *, limit: int | None = None, duration_s: float | None = None, time_scale: float = 1.0
) -> list[TraceRequest]:
    """The trace's requests in arrival order.

    `limit` keeps the first N lines of the file; `duration_s` then keeps the requests within that many
    seconds of trace time (before `time_scale`) of the earliest one. Out-of-order lines are sorted by
    timestamp (stably) and numbered in that order. Raises TraceError naming `file:line` for a line
    that is not a JSON object with the four fields, a negative value, an input_length below 1, or
    hash ids that are not exactly one non-negative integer per 512-token block: a trace with more
    ids than that was hashed with other blocks, and replaying it as 512-token blocks would invent
    its reuse.
    """
    if time_scale <= 0:
        raise TraceError("time scale must be > 0")
    if duration_s is not None and duration_s < 0:
        raise TraceError("duration must be >= 0")
    parsed: list[tuple[float, int, int, tuple[int, ...]]] = []
    try:
        handle = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as exc:
        raise TraceError(f"trace {str(path)!r}: cannot read: {exc.strerror}") from None
    with handle:
        for line_no, line in enumerate(handle, 1):
            if limit is not None and len(parsed) >= limit:
                break
            if line.strip():
                parsed.append(_parse_line(line, f"{path}:{line_no}"))
    if not parsed:
        raise TraceError(f"trace {str(path)!r}: no requests")
    if any(b[0] < a[0] for a, b in zip(parsed, parsed[1:], strict=False)):
        parsed.sort(key=lambda p: p[0])
    if duration_s is not None:
        last_ms = parsed[0][0] + duration_s * 1000
        parsed = [p for p in parsed if p[0] <= last_ms]
    scale = time_scale / 1000.0
    return [
        TraceRequest(index, timestamp * scale, input_length, output_length, hash_ids)
        for index, (timestamp, input_length, output_length, hash_ids) in enumerate(parsed)
    ]


def _parse_line(line: bytes, where: str) -> tuple[float, int, int, tuple[int, ...]]:
    try:
        obj = orjson.loads(line)
    except orjson.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object")
    try:
        timestamp, input_length, output_length, hash_ids = (
            obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
        )
    except KeyError as exc:
        raise TraceError(f"{where}: missing field {exc.args[0]!r}") from None
    # type(...) is int: bool is an int subclass, and "5" or 5.5 are not lengths.
    if type(timestamp) not in (int, float) or timestamp < 0:
        raise TraceError(f"{where}: bad value: timestamp must be a number >= 0, got {timestamp!r}")
    if type(input_length) is not int or input_length < 1:
        raise TraceError(f"{where}: bad value: input_length must be an integer >= 1, got {input_length!r}")
    if type(output_length) is not int or output_length < 0:
        raise TraceError(f"{where}: bad value: output_length must be an integer >= 0, got {output_length!r}")
    if not isinstance(hash_ids, list) or not all(type(h) is int and h >= 0 for h in hash_ids):
        raise TraceError(f"{where}: bad value: hash_ids must be a list of integers >= 0")
    needed = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(hash_ids) != needed:
        raise TraceError(
            f"{where}: input_length {input_length} needs {needed} hash ids (one per "
            f"{TRACE_BLOCK_TOKENS}-token block) but hash_ids has {len(hash_ids)}"
        )
    return float(timestamp), input_length, output_length, tuple(hash_ids)


def ideal_hit_ratio(requests: Iterable[TraceRequest], engine_block_tokens: int = TRACE_BLOCK_TOKENS) -> float:
    """Token-weighted hit ratio of one infinite cache shared by every engine: the bound routing chases.

    Engines cache whole blocks of `engine_block_tokens` and a fully cached prompt still computes
    its last token (as vLLM does), so a request's hit is

        min(floor(shared / engine_block_tokens) * engine_block_tokens, input_length - 1)

    where `shared` is the longest prefix it has in common with any earlier request: its leading
    hash ids seen before, each contributing its tokens in this request (512, or fewer for the
    partial last block) but no more than the most any earlier request held of that block (an
    earlier partial last block covered only its own length). Engine blocks smaller than the trace's
    thus also count the whole engine blocks inside a shared partial trace block: with 256-token
    blocks, a 300-token last block seen before adds 256 tokens.
    """
    if engine_block_tokens < 1:
        raise ValueError("engine_block_tokens must be >= 1")
    covered: dict[int, int] = {}  # hash id -> most tokens of its block any request so far held
    hits = total = 0
    for req in requests:
        n = req.input_length
        shared = 0
        for i, hash_id in enumerate(req.hash_ids):
            length = min(TRACE_BLOCK_TOKENS, n - i * TRACE_BLOCK_TOKENS)
            held = covered.get(hash_id, 0)
            shared += min(length, held)
            if held < length:
                break
        hits += min(shared // engine_block_tokens * engine_block_tokens, n - 1)
        total += n
        for i, hash_id in enumerate(req.hash_ids):
            length = min(TRACE_BLOCK_TOKENS, n - i * TRACE_BLOCK_TOKENS)
            if covered.get(hash_id, 0) < length:
                covered[hash_id] = length
    return hits / total if total else 0.0


def fleet_lru_hit_ratio(requests: Iterable[TraceRequest], capacity_blocks: int) -> float:
    """The same with one LRU cache of 512-token blocks as large as the whole fleet's: what capacity
    alone allows.

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
