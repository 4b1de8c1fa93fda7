"""The trace simulator: real scheduler code path, correct reference ratios, consistent reports."""

from __future__ import annotations

import json
import random

import pytest

from kvgate.cli import main
from kvgate.config.settings import Settings
from kvgate.simulator.profile import DEFAULT_CACHE_BLOCKS, trace_profile
from kvgate.simulator.replay import Replay, hit_ratio_reference, simulate
from kvgate.simulator.trace import ideal_hit_ratio, read_trace
from tests.trace_helpers import row, write_trace

BLOCK = 512


def prefix_heavy_rows(count: int = 240, documents: int = 12) -> list[dict]:
    """Requests that each read one of a few 8-block documents, then ask a unique 1-block question."""
    pick = random.Random(1)
    rows = []
    for i in range(count):
        doc = pick.randrange(documents)
        rows.append(row(i * 250, [1000 * doc + b for b in range(8)] + [10**6 + i], output_length=30))
    return rows


def settings(policy: str, **fields) -> Settings:
    return Settings(dispatch_policy=policy, kvs_chunk_size=BLOCK, **fields)


@pytest.fixture
def prefix_trace(tmp_path):
    return read_trace(write_trace(tmp_path / "prefix.jsonl", prefix_heavy_rows()))


def test_cache_aware_routing_finds_prefixes_round_robin_scatters(prefix_trace):
    # 40 blocks per instance hold ~4 documents: only routing by prefix keeps them warm.
    profile = trace_profile(cache_capacity_blocks=40)
    hit = {
        policy: simulate(prefix_trace, settings(policy), 4, profile, store_model="local").summary.prefix_hit_ratio
        for policy in ("round_robin", "cache_aware", "prefix")
    }
    ideal = ideal_hit_ratio(prefix_trace)
    assert hit["cache_aware"] > hit["round_robin"] + 0.2
    assert hit["prefix"] > hit["round_robin"] + 0.2
    assert hit["cache_aware"] <= ideal + 1e-9


def test_scheduler_settings_reach_the_simulated_gateway(prefix_trace):
    # Raising the cache-aware threshold above every prompt turns cache_aware into least_load.
    profile = trace_profile(cache_capacity_blocks=40)
    high = simulate(
        prefix_trace, settings("cache_aware", cache_aware_scheduling_min_tokens=10**6), 4, profile,
        store_model="local",
    )
    least = simulate(prefix_trace, settings("least_load"), 4, profile, store_model="local")
    aware = simulate(prefix_trace, settings("cache_aware"), 4, profile, store_model="local")
    assert high.ttfts == least.ttfts
    assert aware.summary.prefix_hit_ratio > high.summary.prefix_hit_ratio


def test_replay_leaves_no_account_and_index_equals_the_engines_caches(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=40)
    replay = Replay(
        prefix_trace,
        settings("cache_aware"),
        4,
        profile,
        reference=hit_ratio_reference(prefix_trace, 4 * 40),
        store_model="local",
    )
    result = replay.run()
    assert result.summary.requests == len(prefix_trace) == len(result.ttfts)
    assert replay.account.total_inflight() == 0
    published = {}
    for key in {k for r in prefix_trace for k in replay.scheduler.block_keys(replay.blocks(r))}:
        for endpoint in replay.index.holders(key):
            published.setdefault(endpoint, set()).add(key)
    for inst in replay.instances:
        assert not inst.engine.has_work()
        assert published.get(inst.config.kvs_endpoints[0], set()) == set(inst.engine.cache.keys())


def test_same_seed_same_results(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=40)
    # top-k 2 makes the scheduler draw random numbers: the seed must fix them.
    runs = [
        simulate(prefix_trace, settings("cache_aware", dispatch_top_k=2), 4, profile, seed=seed,
                 store_model="local")
        for seed in (7, 7, 8)
    ]
    assert runs[0].ttfts == runs[1].ttfts
    first, second = (r.summary.to_dict() for r in runs[:2])
    first.pop("wall_time_s"), second.pop("wall_time_s")
    assert first == second
    assert runs[2].ttfts != runs[0].ttfts


def test_json_report_fields_are_present_and_consistent(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(120))
    code = main(["simulate", "--trace", path, "--instances", "3", "--policy", "prefix", "--json"])
    assert code == 0
    body = json.loads(capsys.readouterr().out)
    assert body["policy"] == "prefix" and body["requests"] == 120 and body["instances"] == 3
    assert 0 < body["prefix_hit_ratio"] <= body["ideal_hit_ratio"] <= 1
    assert body["fleet_lru_hit_ratio"] <= body["ideal_hit_ratio"]
    assert 0 < body["p50_ttft_s"] <= body["p90_ttft_s"] <= body["p99_ttft_s"]
    assert body["mean_queue_s"] >= 0 and body["throughput_rps"] > 0
    assert body["max_instance_requests"] >= body["min_instance_requests"]
    assert body["time_scale"] == 1.0 and body["cache_capacity_blocks"] == DEFAULT_CACHE_BLOCKS


def test_policies_table_json_and_plot(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60))
    plot = tmp_path / "cdf.png"
    argv = ["simulate", "--trace", path, "--instances", "2", "--policies", "round_robin,cache_aware"]
    assert main([*argv, "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "round_robin" in out and "cache_aware" in out and "ideal" in out
    assert plot.stat().st_size > 10_000
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert set(body["policies"]) == {"round_robin", "cache_aware"}
    assert all(s["requests"] == 60 for s in body["policies"].values())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--policies", "round_robin,fastest"], "unknown ['fastest']"),
        (["--dispatch-top-k", "0"], "--dispatch-top-k"),
        (["--instances", "0"], "--instances"),
    ],
)
def test_bad_arguments_exit_2_with_a_message(tmp_path, capsys, extra, message):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(5))
    assert main(["simulate", "--trace", path, *extra]) == 2
    assert message in capsys.readouterr().err


def test_missing_trace_file_is_a_clear_error(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "cannot read" in capsys.readouterr().err
