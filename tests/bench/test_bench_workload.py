"""Trace requests -> prompts: deterministic, prefix-sharing exactly where the trace shares hash ids."""

from __future__ import annotations

from kvgate.bench.workload import (
    DEFAULT_VOCABULARY,
    block_tokens,
    build_requests,
    completion_body,
    prompt_token_ids,
)
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest


def trace_request(timestamp_ms: int, input_length: int, output_length: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(0, timestamp_ms / 1000, input_length, output_length, hash_ids)


def test_block_is_a_pure_function_of_the_hash_id():
    block = block_tokens(7)
    assert len(block) == TRACE_BLOCK_TOKENS
    block_tokens.cache_clear()
    assert block_tokens(7) == block  # recomputed, not only cached
    assert block_tokens(8) != block
    assert all(token in DEFAULT_VOCABULARY for token in block)


def test_known_block_prefix_is_stable_across_versions():
    # Pinned so a change of generator (which would silently change every published figure) shows up.
    assert block_tokens(0)[:4] == (27177, 24496, 14037, 9026)


def test_equal_hash_ids_give_equal_prefixes_and_the_last_block_is_cut():
    first = trace_request(0, 2 * TRACE_BLOCK_TOKENS + 100, 10, (1, 2, 3))
    second = trace_request(5, 2 * TRACE_BLOCK_TOKENS + 7, 10, (1, 2, 9))
    a, b = prompt_token_ids(first), prompt_token_ids(second)
    assert len(a) == first.input_length and len(b) == second.input_length
    assert a[: 2 * TRACE_BLOCK_TOKENS] == b[: 2 * TRACE_BLOCK_TOKENS]
    assert a[2 * TRACE_BLOCK_TOKENS :] == block_tokens(3)[:100]
    assert b[2 * TRACE_BLOCK_TOKENS :] == block_tokens(9)[:7]
    assert a[2 * TRACE_BLOCK_TOKENS] != b[2 * TRACE_BLOCK_TOKENS] or block_tokens(3)[:7] != block_tokens(9)[:7]


def test_unused_trailing_hash_ids_are_ignored():
    # read_trace refuses such a request; one built by hand still gets only input_length tokens.
    record = trace_request(0, 10, 1, (4, 5, 6))
    assert prompt_token_ids(record) == block_tokens(4)[:10]


def test_custom_vocabulary():
    vocabulary = (5, 6, 7)
    tokens = prompt_token_ids(trace_request(0, 600, 1, (1, 2)), vocabulary)
    assert set(tokens) <= set(vocabulary) and len(tokens) == 600


def test_build_requests_compresses_time_and_caps_output():
    records = [trace_request(2000, 10, 500, (1,)), trace_request(6000, 20, 0, (1,))]
    requests = build_requests(records, speedup=4, max_tokens_cap=64)
    assert [r.send_at_s for r in requests] == [0.0, 1.0]
    assert [r.max_tokens for r in requests] == [64, 1]  # zero output still asks for one token
    assert requests[1].prompt_token_ids[:10] == requests[0].prompt_token_ids


def test_completion_body_streams_with_usage():
    request = build_requests([trace_request(0, 3, 2, (1,))])[0]
    body = completion_body(request, "m")
    assert body["prompt"] == list(block_tokens(1)[:3])
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == 2 and body["model"] == "m"
