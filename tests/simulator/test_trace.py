"""The one Mooncake trace reader and its hit-ratio references (kvgate.simulator.trace)."""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from kvgate.bench.workload import prompt_token_ids
from kvgate.engine_model import EngineCore, EngineRequest, ServiceProfile
from kvgate.scheduler.hashing import hash_blocks
from kvgate.simulator.trace import (
    TRACE_BLOCK_TOKENS,
    TraceError,
    TraceRequest,
    fleet_lru_hit_ratio,
    ideal_hit_ratio,
    read_trace,
)
from tests.trace_helpers import row, write_trace

BLOCK = TRACE_BLOCK_TOKENS


def request(index: int, input_length: int, hash_ids: tuple[int, ...]) -> TraceRequest:
    return TraceRequest(index, float(index), input_length, 1, hash_ids)


# --- reading ---


def test_limit_duration_and_time_scale(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row(t, [t, t + 1], 600, 3) for t in (1000, 1500, 3000, 9000)])
    assert len(read_trace(path)) == 4
    assert [r.arrival_s for r in read_trace(path, limit=2)] == [1.0, 1.5]
    # duration is trace time from the first request, before time_scale
    assert [r.arrival_s for r in read_trace(path, duration_s=2.0)] == [1.0, 1.5, 3.0]
    assert [r.arrival_s for r in read_trace(path, duration_s=2.0, time_scale=0.5)] == [0.5, 0.75, 1.5]
    assert read_trace(path, limit=1)[0] == TraceRequest(0, 1.0, 600, 3, (1000, 1001))
    assert read_trace(path, limit=1)[0].block_keys == ("1000", "1001")
    assert read_trace(path, limit=1)[0].full_block_keys == ("1000",)


def test_out_of_order_lines_are_sorted_and_renumbered(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [row(3000, [3]), row(1000, [1]), row(2000, [2]), row(1000, [4])])
    trace = read_trace(path)
    assert [(r.index, r.arrival_s, r.hash_ids) for r in trace] == [
        (0, 1.0, (1,)), (1, 1.0, (4,)), (2, 2.0, (2,)), (3, 3.0, (3,))  # equal times keep file order
    ]


def test_blank_lines_are_skipped_and_zero_output_is_kept(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("\n" + json.dumps(row(0, [1], 10, 0)) + "\n\n")
    assert read_trace(path) == [TraceRequest(0, 0.0, 10, 0, (1,))]


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1}', "missing field 'hash_ids'"),
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}',
         "input_length 600 needs 2 hash ids .* has 1"),
        # More ids than blocks: hashed with other blocks (256 tokens here), refused rather than misread.
        ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2, 3]}',
         "input_length 600 needs 2 hash ids .* has 3"),
        ('{"timestamp": 0, "input_length": "x", "output_length": 1, "hash_ids": [1]}', "bad value: input_length"),
        ('{"timestamp": 0, "input_length": 5.5, "output_length": 1, "hash_ids": [1]}', "bad value: input_length"),
        ('{"timestamp": 0, "input_length": 0, "output_length": 1, "hash_ids": []}', "input_length must be .* >= 1"),
        ('{"timestamp": -1, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": true, "input_length": 5, "output_length": 1, "hash_ids": [1]}', "timestamp must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": -1, "hash_ids": [1]}', "output_length must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}', "hash_ids must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": ["a"]}', "hash_ids must be"),
        ('{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": 7}', "hash_ids must be"),
    ],
)
def test_bad_lines_are_named_by_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(row(0, [1], 5)) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        read_trace(path)
    assert "bad.jsonl:2: " in str(info.value)


def test_unreadable_empty_and_bad_arguments(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path / "absent.jsonl")
    with pytest.raises(TraceError, match="cannot read"):
        read_trace(tmp_path)  # a directory
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(TraceError, match="no requests"):
        read_trace(tmp_path / "empty.jsonl")
    path = write_trace(tmp_path / "t.jsonl", [row(0, [1])])
    with pytest.raises(TraceError, match="time scale"):
        read_trace(path, time_scale=0)
    with pytest.raises(TraceError, match="duration"):
        read_trace(path, duration_s=-1)


# --- hit-ratio references ---


def test_ideal_and_fleet_lru_hit_ratios_by_hand(tmp_path):
    trace = read_trace(
        write_trace(
            tmp_path / "t.jsonl",
            [
                row(0, [1, 2]),  # 1024 tokens, nothing seen: 0
                row(1, [1, 2, 3], 1300),  # blocks 1, 2 seen: 1024 (block 3 is partial, never cached)
                row(2, [1, 9]),  # block 1: 512
                row(3, [1, 2]),  # everything cached: still computes one token, 1023
                row(4, [1, 2, 3], 1300),  # 3 was partial before, so 1024 again
            ],
        )
    )
    total = 1024 + 1300 + 1024 + 1024 + 1300
    assert ideal_hit_ratio(trace) == pytest.approx((1024 + 512 + 1023 + 1024) / total)
    # Two blocks of LRU: [1, 9] pushes 2 out, so request 4 finds only block 1; it brings 2 back for 5.
    assert fleet_lru_hit_ratio(trace, 2) == pytest.approx((1024 + 512 + 512 + 1024) / total)
    assert ideal_hit_ratio([]) == 0.0


def test_ideal_hit_ratio_counts_leading_blocks_seen_before():
    records = [
        request(0, 1024, (1, 2)),
        request(1, 1536, (1, 2, 3)),  # 1024 reused
        request(2, 1024, (9, 2)),  # block 2 seen, but not as a prefix: 0
        request(3, 700, (1, 2)),  # whole prompt seen: 512 in 512-token blocks (699 would split one)
    ]
    assert ideal_hit_ratio(records) == pytest.approx((1024 + 512) / (1024 + 1536 + 1024 + 700))


def test_ideal_hit_ratio_with_smaller_engine_blocks_counts_shared_partial_blocks():
    # Hash id 2 is a partial last block of 300, then 388, then 512 tokens.
    records = [
        request(0, 812, (1, 2)),  # nothing seen: 0
        request(1, 1024, (1, 3)),  # block 1: 512
        request(2, 900, (1, 2)),  # 512 + the 300 of 2 seen: 812 shared
        request(3, 812, (1, 2)),  # 512 + 300 (of the 388 seen): 812 shared
        request(4, 1024, (1, 2)),  # 512 + 388 (of its 512): 900 shared
        request(5, 1024, (1, 2)),  # everything: 1024 shared, capped at 1023
    ]
    total = 812 + 1024 + 900 + 812 + 1024 + 1024
    # 256-token engine blocks: 812 -> 768 (three blocks), 900 -> 768.
    assert ideal_hit_ratio(records, engine_block_tokens=256) == pytest.approx(
        (0 + 512 + 768 + 768 + 768 + 1023) / total
    )
    # 512-token blocks: only block 1 until 2 has been seen whole.
    assert ideal_hit_ratio(records) == pytest.approx((0 + 512 + 512 + 512 + 512 + 1023) / total)
    with pytest.raises(ValueError):
        ideal_hit_ratio(records, engine_block_tokens=0)


def conversation_trace(count: int, seed: int) -> list[TraceRequest]:
    """Requests reading growing prefixes of a few conversations, half of them after one shared
    system block, with partial last blocks of any length: equal ids always mean an equal prefix."""
    rng = random.Random(seed)
    conversations = [([0] if c % 2 else []) + [1000 * (c + 1) + b for b in range(6)] for c in range(5)]
    out = []
    for index in range(count):
        ids = rng.choice(conversations)
        blocks = rng.randint(1, len(ids))
        length = (blocks - 1) * BLOCK + rng.choice([1, 255, 256, 300, 511, 512, rng.randint(1, BLOCK)])
        out.append(request(index, length, tuple(ids[:blocks])))
    return out


@pytest.mark.parametrize("engine_block_tokens", [16, 256, 300, 512])
def test_ideal_hit_ratio_equals_an_engine_with_room_for_everything(engine_block_tokens):
    # The trace's prompts, hashed into the engine's blocks as the gateway does, one at a time
    # through the engine model with an unbounded cache: it must find exactly the bound.
    trace = conversation_trace(60, seed=engine_block_tokens)
    profile = dataclasses.replace(
        ServiceProfile().with_block_size(engine_block_tokens), cache_capacity_blocks=10**6
    )
    engine = EngineCore(profile)
    now = 0.0
    for req in trace:
        tokens = prompt_token_ids(req)
        keys = tuple(b.value for b in hash_blocks("sha256_cbor", tokens, engine_block_tokens))
        engine.submit(EngineRequest(str(req.index), keys, req.input_length, 1), now)
        while engine.has_work():
            now += engine.step(now).duration_s
    stats = engine.stats()
    assert stats.prefix_cache_queries == sum(r.input_length for r in trace)
    assert stats.prefix_cache_hits > 0
    assert ideal_hit_ratio(trace, engine_block_tokens) == pytest.approx(
        stats.prefix_cache_hits / stats.prefix_cache_queries
    )
