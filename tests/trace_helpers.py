"""Mooncake-format trace files for tests: one JSON object per line, one hash id per 512-token block."""

from __future__ import annotations

import json

from kvgate.simulator.trace import TRACE_BLOCK_TOKENS


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def row(ms: float, hash_ids: list[int], input_length: int | None = None, output_length: int = 20) -> dict:
    """A trace line; the prompt fills its blocks unless `input_length` says otherwise."""
    n = input_length if input_length is not None else TRACE_BLOCK_TOKENS * len(hash_ids)
    return {"timestamp": ms, "input_length": n, "output_length": output_length, "hash_ids": hash_ids}
