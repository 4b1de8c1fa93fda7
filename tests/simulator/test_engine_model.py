"""The engine service model: caching, batching and timing behave like a real continuous-batching engine."""

from __future__ import annotations

import pytest

from kvgate.engine_model import BlockCache, EngineCore, EngineRequest, ServiceProfile

BS = 16


def profile(**overrides) -> ServiceProfile:
    fields = dict(block_size=BS, cache_capacity_blocks=4096, max_batch_tokens=256, prefill_share_tokens=32)
    fields.update(overrides)
    return ServiceProfile(**fields)


def request(rid: str, prefix: str, num_tokens: int, max_tokens: int = 4) -> EngineRequest:
    keys = tuple(f"{prefix}-{i}" for i in range(num_tokens // BS))
    return EngineRequest(rid, keys, num_tokens, max_tokens)


def run(engine: EngineCore, arrivals: list[tuple[float, EngineRequest]], fast_forward: bool = False):
    """Drive the engine in virtual time; returns ({id: first token time}, {id: finish time}, step count)."""
    pending = sorted(arrivals, key=lambda a: a[0])
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    now, steps = 0.0, 0
    while pending or engine.has_work():
        while pending and pending[0][0] <= now:
            engine.submit(pending.pop(0)[1], now)
        if not engine.has_work():
            now = pending[0][0]
            continue
        until = pending[0][0] if pending else float("inf")
        out = engine.step(now, fast_forward_until=until if fast_forward else None)
        now += out.duration_s
        steps += 1
        first.update((rid, now) for rid in out.first_tokens)
        finish.update((rid, now) for rid in out.finished)
    return first, finish, steps


def test_default_prefill_curve_resembles_an_8b_model_on_one_gpu():
    p = ServiceProfile()

    def ttft(n):
        return p.step_overhead_s + p.prefill.chunk_s(0, n)

    assert 0.025 <= ttft(1024) <= 0.040
    assert 0.30 <= ttft(8192) <= 0.5
    assert 2.0 <= ttft(32768) <= 3.0


def test_chunking_does_not_change_total_prefill_compute():
    cost = ServiceProfile().prefill
    whole = cost.chunk_s(0, 8192)
    chunked = sum(cost.chunk_s(c, 2048) for c in range(0, 8192, 2048))
    assert chunked == pytest.approx(whole)


def test_table_profile_interpolates_and_keeps_chunks_consistent():
    p = ServiceProfile.from_table([(1000, 0.05), (4000, 0.35)], step_overhead_s=0.01)
    assert p.step_overhead_s + p.prefill.chunk_s(0, 1000) == pytest.approx(0.05)
    assert p.step_overhead_s + p.prefill.chunk_s(0, 4000) == pytest.approx(0.35)
    assert p.prefill.chunk_s(0, 2000) + p.prefill.chunk_s(2000, 2000) == pytest.approx(
        p.prefill.chunk_s(0, 4000)
    )
    assert p.prefill.chunk_s(4000, 1000) == pytest.approx(
        p.prefill.chunk_s(3000, 1000)
    )  # last slope continues
    with pytest.raises(ValueError):
        ServiceProfile.from_table([(4000, 0.3), (1000, 0.1)])


def test_repeated_prefix_prefills_faster_and_counts_hits():
    engine = EngineCore(profile())
    first, _, _ = run(engine, [(0.0, request("a", "doc", 2048))])
    cold = first["a"]
    first, _, _ = run(engine, [(0.0, request("b", "doc", 2048 + 64))])
    warm = first["b"]
    assert warm < cold / 5
    engine.submit(request("c", "doc", 1024 + 8), 0.0)  # 64 full blocks, all cached
    assert engine.step(0.0).cached_tokens == {"c": 1024}
    stats = engine.stats()
    assert stats.prefix_cache_queries == 2048 + 2048 + 64 + 1024 + 8
    assert stats.prefix_cache_hits == 2048 + 1024


def test_request_queued_behind_same_prefix_reuses_it_when_admitted():
    # One running slot: the second request waits, and is matched only when admitted.
    engine = EngineCore(profile(max_running_requests=1))
    first, _, _ = run(
        engine, [(0.0, request("a", "doc", 1024, max_tokens=2)), (0.0, request("b", "doc", 1024))]
    )
    assert engine.stats().prefix_cache_hits == 1024 - 1  # a fully cached prompt still computes one token
    assert first["b"] - first["a"] < first["a"] / 4


def test_two_long_prompts_queue():
    p = profile()
    alone = run(EngineCore(p), [(0.0, request("x", "x", 4096))])[0]["x"]
    first, _, _ = run(EngineCore(p), [(0.0, request("a", "a", 4096)), (0.0, request("b", "b", 4096))])
    assert max(first.values()) >= 1.9 * alone
    assert first["a"] < first["b"]  # arrival order keeps the larger share


def test_chunked_prefill_lets_a_short_prompt_overtake_a_long_one():
    p = profile()
    first, _, _ = run(EngineCore(p), [(0.0, request("long", "l", 16384)), (0.01, request("short", "s", 64))])
    assert first["short"] < first["long"]
    short_alone = run(EngineCore(p), [(0.0, request("s", "s", 64))])[0]["s"]
    assert first["short"] - 0.01 < 4 * short_alone + p.step_overhead_s * 2 + p.prefill.chunk_s(0, 256)


def test_decode_step_time_grows_with_batch():
    def decode_step(batch: int) -> float:
        engine = EngineCore(profile())
        for i in range(batch):
            engine.submit(request(f"r{i}", f"p{i}", 64, max_tokens=10), 0.0)
        while True:
            out = engine.step(0.0)
            if out.tokens and not out.first_tokens and out.prefill_tokens_computed == 0:
                return out.duration_s

    times = [decode_step(b) for b in (1, 8, 32)]
    assert times[0] < times[1] < times[2]


def test_lru_evicts_least_recently_used_first():
    cache = BlockCache(3)
    assert cache.insert(["a", "b", "c"]) == []
    assert cache.match_prefix(["a"]) == 1  # touching a makes b the oldest
    assert cache.insert(["d"]) == ["b"]
    assert cache.insert(["e", "f"]) == ["c", "a"]
    assert sorted(cache.keys()) == ["d", "e", "f"] and len(cache) == 3


def test_match_prefix_is_contiguous_from_the_first_key():
    cache = BlockCache(8)
    cache.insert(["a", "b", "d"])
    assert cache.match_prefix(["a", "b", "c", "d"]) == 2
    assert cache.match_prefix(["x", "a"]) == 0


def test_pinned_blocks_survive_eviction_and_reservations_respect_capacity():
    cache = BlockCache(3)
    cache.insert(["a", "b", "c"])
    cache.pin(["a"])
    assert cache.insert(["d", "e"]) == ["b", "c"]
    assert "a" in cache
    assert cache.reserve(3) is None  # a is pinned: only d and e can make room
    assert len(cache) == 3
    assert cache.reserve(1) == ["d"]
    assert cache.used_blocks == 2  # a pinned + 1 reserved
    cache.unpin(["a"])
    cache.release(1)
    assert cache.used_blocks == 0 and cache.free_blocks == 1


def test_cache_change_callbacks_report_added_then_evicted_blocks():
    changes: list[tuple[list[str], list[str]]] = []
    # 12 blocks: each request needs 4 prompt blocks + 1 for its answer, so the third evicts the first.
    engine = EngineCore(
        profile(cache_capacity_blocks=12), on_cache_change=lambda a, e: changes.append((a, e))
    )
    run(engine, [(0.0, request("a", "a", 64))])
    assert [k for added, _ in changes for k in added] == ["a-0", "a-1", "a-2", "a-3"]
    run(engine, [(0.0, request("b", "b", 64))])
    run(engine, [(0.0, request("c", "c", 64)), (0.0, request("d", "d", 64))])
    evicted = [k for _, ev in changes for k in ev]
    assert evicted[:4] == ["a-0", "a-1", "a-2", "a-3"]  # least recently used go first
    assert set(engine.cache.keys()) == {f"{p}-{i}" for p in "cd" for i in range(4)} | {"b-3", "b-2"}


def test_memory_limits_admission_and_queued_requests_wait():
    # Capacity for one request at a time (4 prompt blocks + 1 decode block each).
    engine = EngineCore(profile(cache_capacity_blocks=6))
    engine.submit(request("a", "a", 64), 0.0)
    engine.submit(request("b", "b", 64), 0.0)
    engine.step(0.0)
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting) == (1, 1)
    assert engine.uncomputed_prefill_tokens() == 64  # b's prompt; a's is computed
    with pytest.raises(ValueError, match="exceeds the KV capacity"):
        engine.submit(request("huge", "h", 6 * BS), 0.0)


def test_cancel_frees_slots_pins_and_memory():
    engine = EngineCore(profile(max_running_requests=1))
    engine.submit(request("a", "a", 4096, max_tokens=100), 0.0)
    engine.submit(request("b", "b", 4096), 0.0)
    engine.step(0.0)
    assert engine.stats().num_running == 1 and engine.cache.used_blocks > 0
    assert engine.cancel("a")
    assert engine.cancel("b")
    assert not engine.cancel("a")
    stats = engine.stats()
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage_ratio) == (0, 0, 0.0)
    assert engine.uncomputed_prefill_tokens() == 0
    # Blocks a computed stay cached but are evictable: the whole capacity can be reserved again.
    assert len(engine.cache) > 0
    assert engine.cache.reserve(engine.cache.capacity_blocks) is not None
    assert not engine.has_work()


def test_every_account_returns_to_zero_after_a_busy_run():
    engine = EngineCore(profile(cache_capacity_blocks=160))
    arrivals = [
        (i * 0.003, request(f"r{i}", f"p{i % 5}", 100 + 17 * i, max_tokens=1 + i % 7)) for i in range(40)
    ]
    _, finish, _ = run(engine, arrivals)
    assert len(finish) == 40
    assert engine.cache.used_blocks == 0 and engine.uncomputed_prefill_tokens() == 0
    stats = engine.stats()
    assert stats.prefix_cache_queries == sum(r.num_prompt_tokens for _, r in arrivals)
    assert 0 < stats.prefix_cache_hits < stats.prefix_cache_queries


def test_fast_forward_equals_stepping_one_by_one():
    arrivals = [
        (i * 0.05, request(f"r{i}", f"p{i % 3}", 300 + 50 * i, max_tokens=20 + 13 * i)) for i in range(12)
    ]
    slow_first, slow_finish, slow_steps = run(EngineCore(profile()), arrivals)
    fast_first, fast_finish, fast_steps = run(EngineCore(profile()), arrivals, fast_forward=True)
    assert fast_first == pytest.approx(slow_first)
    assert fast_finish == pytest.approx(slow_finish)
    assert fast_steps < slow_steps / 3


def test_engine_is_deterministic():
    arrivals = [(i * 0.01, request(f"r{i}", f"p{i % 4}", 200 + 31 * i, max_tokens=5)) for i in range(20)]
    assert run(EngineCore(profile()), arrivals) == run(EngineCore(profile()), arrivals)


def _with_output(rid: str, num_tokens: int, max_tokens: int) -> EngineRequest:
    """A request naming the blocks its output fills: those after its prompt's full blocks."""
    kv_tokens = num_tokens + max_tokens - 1  # the last generated token's KV is never computed
    keys = tuple(f"{rid}-{i}" for i in range(kv_tokens // BS))
    split = num_tokens // BS
    return EngineRequest(rid, keys[:split], num_tokens, max_tokens, output_block_keys=keys[split:])


def test_output_blocks_are_cached_once_their_kv_is_computed():
    added_at: dict[str, int] = {}
    produced = 0

    def on_change(added: list[str], evicted: list[str]) -> None:
        for key in added:
            added_at[key] = produced  # tokens out before the step that cached it

    engine = EngineCore(profile(), on_cache_change=on_change)
    req = _with_output("a", 20, max_tokens=30)  # KV of 20 + 29 tokens: blocks 0 (prompt), 1, 2 (output)
    assert req.output_block_keys == ("a-1", "a-2")
    engine.submit(req, 0.0)
    now = 0.0
    while engine.has_work():
        out = engine.step(now)
        produced += len(out.first_tokens) + len(out.tokens)
        now += out.duration_s
    # Block 1 holds tokens 16..31: token 31, the 12th generated, gets its KV in the step making the 13th.
    assert added_at == {"a-0": 0, "a-1": 12, "a-2": 28}
    assert set(engine.cache.keys()) == {"a-0", "a-1", "a-2"} and engine.cache.used_blocks == 0


def test_output_blocks_fast_forward_and_cancel_like_prompt_blocks():
    arrivals = [(i * 0.05, _with_output(f"r{i}", 300 + 50 * i, 20 + 13 * i)) for i in range(12)]
    slow, fast = EngineCore(profile()), EngineCore(profile())
    slow_first, slow_finish, _ = run(slow, arrivals)
    fast_first, fast_finish, _ = run(fast, arrivals, fast_forward=True)
    assert fast_first == pytest.approx(slow_first) and fast_finish == pytest.approx(slow_finish)
    assert slow.cache.keys() == fast.cache.keys() and "r11-62" in fast.cache  # its last output block
    assert fast.cache.used_blocks == 0

    engine = EngineCore(profile())
    engine.submit(_with_output("c", 20, max_tokens=100), 0.0)
    for _ in range(20):
        engine.step(0.0)
    assert "c-1" in engine.cache and engine.cancel("c")
    assert engine.cache.used_blocks == 0 and "c-1" in engine.cache  # cached, evictable
    with pytest.raises(ValueError, match="every full prompt block"):
        engine.submit(EngineRequest("d", (), 40, 5, output_block_keys=("x",)), 0.0)
