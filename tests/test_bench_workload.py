"""Trace -> prompts: deterministic, prefix-sharing exactly where the trace shares hash ids."""

from __future__ import annotations

import json

import pytest

from kvgate.bench.workload import (
    BLOCK_TOKENS,
    DEFAULT_VOCABULARY,
    TraceError,
    TraceRecord,
    block_tokens,
    build_requests,
    completion_body,
    ideal_hit_ratio,
    prompt_token_ids,
    read_trace,
)


def write_trace(path, rows) -> str:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_block_is_a_pure_function_of_the_hash_id():
    block = block_tokens(7)
    assert len(block) == BLOCK_TOKENS
    block_tokens.cache_clear()
    assert block_tokens(7) == block  # recomputed, not only cached
    assert block_tokens(8) != block
    assert all(token in DEFAULT_VOCABULARY for token in block)


def test_known_block_prefix_is_stable_across_versions():
    # Pinned so a change of generator (which would silently change every published figure) shows up.
    assert block_tokens(0)[:4] == (27177, 24496, 14037, 9026)


def test_equal_hash_ids_give_equal_prefixes_and_the_last_block_is_cut():
    first = TraceRecord(0, 2 * BLOCK_TOKENS + 100, 10, (1, 2, 3))
    second = TraceRecord(5, 2 * BLOCK_TOKENS + 7, 10, (1, 2, 9))
    a, b = prompt_token_ids(first), prompt_token_ids(second)
    assert len(a) == first.input_length and len(b) == second.input_length
    assert a[: 2 * BLOCK_TOKENS] == b[: 2 * BLOCK_TOKENS]
    assert a[2 * BLOCK_TOKENS :] == block_tokens(3)[:100]
    assert b[2 * BLOCK_TOKENS :] == block_tokens(9)[:7]
    assert a[2 * BLOCK_TOKENS] != b[2 * BLOCK_TOKENS] or block_tokens(3)[:7] != block_tokens(9)[:7]


def test_unused_trailing_hash_ids_are_ignored():
    record = TraceRecord(0, 10, 1, (4, 5, 6))
    assert prompt_token_ids(record) == block_tokens(4)[:10]


def test_custom_vocabulary():
    vocabulary = (5, 6, 7)
    tokens = prompt_token_ids(TraceRecord(0, 600, 1, (1, 2)), vocabulary)
    assert set(tokens) <= set(vocabulary) and len(tokens) == 600


def test_read_trace_limit_and_duration(tmp_path):
    rows = [{"timestamp": t, "input_length": 600, "output_length": 3, "hash_ids": [t, t + 1]} for t in
            (1000, 1500, 3000, 9000)]
    path = write_trace(tmp_path / "t.jsonl", rows)
    assert len(read_trace(path)) == 4
    assert [r.timestamp_ms for r in read_trace(path, limit=2)] == [1000, 1500]
    assert [r.timestamp_ms for r in read_trace(path, duration_s=2.0)] == [1000, 1500, 3000]
    assert read_trace(path, limit=1)[0] == TraceRecord(1000, 600, 3, (1000, 1001))


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "needs 2 blocks"),
        ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "bad value"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": [1]}', "input_length >= 1"),
    ],
)
def test_bad_trace_lines_are_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [1]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:2" in str(info.value)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")


def test_build_requests_compresses_time_and_caps_output():
    records = [TraceRecord(2000, 10, 500, (1,)), TraceRecord(6000, 20, 0, (1,))]
    requests = build_requests(records, speedup=4, max_tokens_cap=64)
    assert [r.send_at_s for r in requests] == [0.0, 1.0]
    assert [r.max_tokens for r in requests] == [64, 1]  # zero output still asks for one token
    assert requests[1].prompt_token_ids[:10] == requests[0].prompt_token_ids


def test_completion_body_streams_with_usage():
    request = build_requests([TraceRecord(0, 3, 2, (1,))])[0]
    body = completion_body(request, "m")
    assert body["prompt"] == list(block_tokens(1)[:3])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 2 and body["model"] == "m"


def test_ideal_hit_ratio_counts_leading_blocks_seen_before():
    records = [
        TraceRecord(0, 1024, 1, (1, 2)),
        TraceRecord(1, 1536, 1, (1, 2, 3)),  # 1024 reused
        TraceRecord(2, 1024, 1, (9, 2)),  # block 2 seen, but not as a prefix: 0
        TraceRecord(3, 700, 1, (1, 2)),  # whole prompt seen: capped at its 700 tokens
    ]
    assert ideal_hit_ratio(records) == pytest.approx((1024 + 700) / (1024 + 1536 + 1024 + 700))
    assert ideal_hit_ratio([]) == 0.0
