"""The shared store model of the simulator and its SLO accounting."""

from __future__ import annotations

import json

import pytest

from kvgate.cli import main
from kvgate.engine_model import EngineCore, EngineRequest, ServiceProfile
from kvgate.engine_model.store import SharedStore, StoreProfile
from kvgate.simulator.oracle import ORACLE_NAME, OracleReplay
from kvgate.simulator.profile import trace_profile
from kvgate.simulator.replay import Replay, hit_ratio_reference, simulate
from kvgate.simulator.report import percentile
from kvgate.simulator.trace import read_trace
from tests.simulator.test_simulator import prefix_heavy_rows, settings
from tests.trace_helpers import row, write_trace

BS = 16
# 1 MB per block: 1 ms from the own segment (1 GB/s), 4 ms from another (250 MB/s).
STORE = StoreProfile(kv_bytes_per_token=1_000_000 // BS, host_bytes_per_s=1e9, network_bytes_per_s=0.25e9)


def test_segments_keep_what_they_computed_once_and_evict_lru_per_segment():
    store = SharedStore(2, 2, BS, STORE)
    assert store.store(0, ["k1", "k2"]) == (["k1", "k2"], [])
    assert store.store(1, ["k1", "k3"]) == (["k3"], [])  # k1 is held: a second put adds no replica
    assert store.holder("k1") == 0
    assert store.plan_load(1, ["k1", "k3", "k9"]).blocks == 2  # touches k1 in segment 0
    assert store.store(0, ["k4"]) == (["k4"], ["k2"])  # k2 was segment 0's least recently used
    load = store.plan_load(1, ["k1", "k3", "k4"])
    assert (load.own_blocks, load.remote_blocks) == (1, 2)
    assert load.seconds == pytest.approx(0.001 + 2 * 0.004)


def test_an_instance_loads_another_segments_prefix_instead_of_computing_it():
    profile = ServiceProfile(block_size=BS, cache_capacity_blocks=64)
    store = SharedStore(2, 64, BS, STORE)
    cores = [
        EngineCore(profile, lambda added, evicted, slot=slot: store.store(slot, added),
                   lambda keys, slot=slot: store.plan_load(slot, keys))
        for slot in range(2)
    ]
    keys = tuple(f"k{i}" for i in range(8))
    request = EngineRequest("r", keys, 8 * BS + 5, 1)
    cores[0].submit(request, 0.0)
    first = cores[0].step(0.0)
    assert first.prefill_tokens_computed == 8 * BS + 5 and first.loaded_remote_tokens == 0
    cores[1].submit(EngineRequest("r", keys, 8 * BS + 5, 1), 1.0)
    second = cores[1].step(1.0)
    assert second.loaded_remote_tokens == 8 * BS and second.loaded_own_tokens == 0
    assert second.prefill_tokens_computed == 5
    alone = EngineCore(profile)
    alone.submit(EngineRequest("r", keys, 8 * BS + 5, 1), 0.0)
    computed = alone.step(0.0)
    # 8 blocks over the network (32 ms) instead of computing 128 tokens; the last 5 computed.
    assert second.duration_s == pytest.approx(profile.step_overhead_s + 0.032 + profile.prefill.chunk_s(8 * BS, 5))
    assert computed.duration_s == pytest.approx(profile.step_overhead_s + profile.prefill.chunk_s(0, 8 * BS + 5))


def test_a_block_hot_in_hbm_that_the_store_evicted_is_written_back_when_used():
    profile = ServiceProfile(block_size=BS, cache_capacity_blocks=64)
    store = SharedStore(1, 2, BS, STORE)
    core = EngineCore(profile, lambda added, evicted: store.store(0, added),
                      lambda keys: store.plan_load(0, keys), lambda keys: store.restore(0, keys))
    core.submit(EngineRequest("a", ("k0", "k1"), 2 * BS + 1, 1), 0.0)
    core.step(0.0)
    assert store.store(0, ["x1", "x2"]) == (["x1", "x2"], ["k0", "k1"])  # the segment moved on
    assert store.holder("k0") is None and "k0" in core.cache
    core.submit(EngineRequest("b", ("k0", "k1"), 2 * BS + 1, 1), 1.0)
    out = core.step(1.0)
    assert out.cached_tokens["b"] == 2 * BS and out.prefill_tokens_computed == 1  # an HBM hit
    assert (store.holder("k0"), store.holder("k1")) == (0, 0)  # written back
    # Held keys are not touched by a write-back: x2 stays the most recent of what was there.
    assert store.restore(0, ["k0", "k1"]) == ([], [])


def test_the_index_keeps_a_first_block_every_request_shares(tmp_path):
    """As in the Mooncake trace, every request starts with the same block: it stays hot in HBM, so
    the store would evict it (nobody loads it) and the gateway would see no prefix anywhere."""
    rows = [{**r, "hash_ids": [0, *r["hash_ids"][4:]], "input_length": 6 * 512}
            for r in prefix_heavy_rows()]
    trace = read_trace(write_trace(tmp_path / "shared-first.jsonl", rows))
    profile = trace_profile(cache_capacity_blocks=96)  # 12 HBM blocks, 84 in each segment
    replay = Replay(trace, settings("least_load"), 2, profile, store_model="shared",
                    reference=hit_ratio_reference(trace, 2 * 96))
    replay.run()
    distinct = {h for r in rows for h in r["hash_ids"]}
    assert len(distinct) > 2 * 84  # the segments turned over
    first = replay.scheduler.block_keys(replay.blocks(trace[0]))[0]
    assert replay.store.holder(first) is not None and replay.index.holders(first)


@pytest.fixture
def prefix_trace(tmp_path):
    return read_trace(write_trace(tmp_path / "prefix.jsonl", prefix_heavy_rows()))


def test_shared_store_lets_every_instance_use_every_prefix(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=80)
    local = simulate(prefix_trace, settings("round_robin"), 4, profile, store_model="local").summary
    shared_replay = Replay(prefix_trace, settings("round_robin"), 4, profile, store_model="shared",
                           reference=hit_ratio_reference(prefix_trace, 4 * 80))
    shared = shared_replay.run().summary
    assert local.transfer_tokens == 0 and shared.transfer_tokens > 0
    # Round robin scatters a document's readers; only the pool lets them reuse it.
    assert shared.prefix_hit_ratio > local.prefix_hit_ratio + 0.2
    # The index reports the segments: each stored block under its one holder's endpoint.
    store = shared_replay.store
    for request in prefix_trace:
        for key in shared_replay.scheduler.block_keys(shared_replay.blocks(request)):
            holder = store.holder(key)
            expected = set() if holder is None else {shared_replay.instances[holder].config.kvs_endpoints[0]}
            assert set(shared_replay.index.holders(key)) == expected
    assert shared_replay.account.total_inflight() == 0


def test_json_reports_slo_attainment_goodput_rejections_and_transfers(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(120))
    base = ["simulate", "--trace", path, "--instances", "2", "--policy", "conductor", "--json",
            "--time-scale", "0.05", "--ttft-slo-s", "0.3", "--tbt-slo-s", "0.2"]
    bodies = {}
    for mode in ("none", "early", "predictive"):
        assert main([*base, "--early-rejection", mode]) == 0
        bodies[mode] = json.loads(capsys.readouterr().out)
    for mode, body in bodies.items():
        assert body["store_model"] == "shared"
        assert body["requests"] + body["rejected"] == 120, mode
        assert 0 <= body["slo_attainment"] <= 1 and body["goodput_rps"] >= 0 and body["transfer_tokens"] >= 0
    assert bodies["none"]["rejected"] == 0
    assert bodies["early"]["rejected"] > 0
    # Served within SLO / arrived, consistent with goodput over the makespan.
    body = bodies["early"]
    assert body["goodput_rps"] == pytest.approx(body["slo_attainment"] * 120 / body["makespan_s"])


def test_summary_reports_the_ttft_models_error_on_every_served_request(prefix_trace):
    replay = Replay(prefix_trace, settings("conductor"), 2, trace_profile(cache_capacity_blocks=80),
                    store_model="shared", reference=hit_ratio_reference(prefix_trace, 2 * 80))
    predicted: dict[int, float] = {}
    observe = replay.scheduler.observe_dispatch

    def record(decision, instance_id, num_prompt_tokens, max_tokens):
        prediction = observe(decision, instance_id, num_prompt_tokens, max_tokens)
        predicted[len(predicted)] = prediction.predicted_ttft_s  # requests dispatch in trace order
        return prediction

    replay.scheduler.observe_dispatch = record
    summary = replay.run().summary
    # Dispatch is at arrival in the simulator: measured TTFT minus the prediction made then.
    errors = sorted(replay.ttft[i] - predicted[i] for i in range(len(prefix_trace)))
    assert len(replay.prediction_errors) == len(prefix_trace)
    assert sorted(replay.prediction_errors) == pytest.approx(errors)
    assert summary.prediction_error_p50_s == pytest.approx(percentile(errors, 50))
    assert summary.prediction_error_p10_s <= summary.prediction_error_p50_s <= summary.prediction_error_p90_s


def test_the_oracle_sends_a_request_where_its_first_token_comes_first(tmp_path, capsys):
    """Two long prompts at once: the second goes to the idle instance. A third, continuing the first
    conversation once both are idle, goes where its prefix is in HBM (no load from the store)."""
    first = list(range(40))
    rows = [row(0, first), row(1, list(range(100, 140))), row(60_000, [*first, 900])]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", rows))
    profile = trace_profile()
    replay = OracleReplay(trace, settings("least_load"), 2, profile, store_model="shared",
                          reference=hit_ratio_reference(trace, 2 * profile.cache_capacity_blocks))
    lru_before_forecasts = []
    forecast = replay._forecast

    def watched(slot, req, now):
        lru_before_forecasts.append([list(segment) for segment in replay.store._segments])
        result = forecast(slot, req, now)
        # Forecasting touches neither the store's recency nor the engines.
        assert [list(segment) for segment in replay.store._segments] == lru_before_forecasts[-1]
        return result

    replay._forecast = watched
    summary = replay.run().summary
    assert summary.policy == ORACLE_NAME
    assert [inst.requests for inst in replay.instances] == [2, 1]
    assert replay.instances[0].engine.stats().prefix_cache_hits == 40 * 512  # the third's HBM hit
    assert summary.transfer_tokens == 0 and replay.account.total_inflight() == 0
    # The CLI adds it as a row beside the policies.
    assert main(["simulate", "--trace", str(tmp_path / "t.jsonl"), "--instances", "2", "--oracle",
                 "--policy", "least_load", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert set(body["policies"]) == {"least_load", ORACLE_NAME}
