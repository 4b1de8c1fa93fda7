"""The simulator's kv_events cache view: the gateway routes on each instance's own cache as its KV
events report it, late; the same scheduler code runs as with the store's index."""

from __future__ import annotations

import json
import math

import pytest

from kvgate.cli import main
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.simulator.kv_events_view import KVEventsView
from kvgate.simulator.profile import trace_profile
from kvgate.simulator.replay import Replay, hit_ratio_reference, simulate
from kvgate.simulator.trace import read_trace
from tests.simulator.test_simulator import prefix_heavy_rows, settings
from tests.trace_helpers import write_trace


@pytest.fixture
def prefix_trace(tmp_path):
    return read_trace(write_trace(tmp_path / "prefix.jsonl", prefix_heavy_rows()))


def test_a_step_s_changes_reach_the_index_lag_after_the_step_ends():
    index = EmbeddedKVSIndex()
    view = KVEventsView(index, lag_s=0.5)
    record = view.recorder("a")
    record(["k1", "k2"], [])
    view.step_ends("a", at=1.0)
    record(["k3"], ["k1"])  # the next step evicts k1 while admitting, then stores k3
    view.step_ends("a", at=2.0)
    view.deliver_until(1.49)
    assert len(index) == 0
    view.deliver_until(1.5)
    assert index.holders("k1") == ("a",) and index.holders("k2") == ("a",) and not index.holders("k3")
    view.deliver_until(2.5)
    assert not index.holders("k1") and index.holders("k2") == ("a",) and index.holders("k3") == ("a",)


def test_a_block_evicted_then_loaded_again_in_one_step_stays_known():
    index = EmbeddedKVSIndex()
    view = KVEventsView(index, lag_s=0.0)
    record = view.recorder("a")
    record(["k1"], [])
    view.step_ends("a", at=1.0)
    record(["k1"], [])  # loaded back from the store at admission...
    record([], ["k1"])  # ...after the same admission's room-making evicted it (reported at the step's end)
    view.step_ends("a", at=2.0)
    view.deliver_until(2.0)
    assert index.holders("k1") == ("a",)


def test_events_index_equals_the_engines_caches_once_delivered(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=40)
    replay = Replay(prefix_trace, settings("cache_aware"), 4, profile, store_model="local",
                    reference=hit_ratio_reference(prefix_trace, 4 * 40), cache_view="kv_events",
                    kv_events_lag_s=0.2)
    replay.run()
    assert replay.account.total_inflight() == 0
    replay.events.deliver_until(math.inf)
    keys = {k for r in prefix_trace for k in replay.scheduler.block_keys(replay.blocks(r))}
    for inst in replay.instances:
        endpoint = inst.config.kvs_endpoints[0]
        assert {k for k in keys if endpoint in replay.index.holders(k)} == set(inst.engine.cache.keys())


def test_with_a_shared_store_the_events_index_holds_hbm_only(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=80)  # 10 HBM blocks per instance, 70 in its segment
    replay = Replay(prefix_trace, settings("round_robin"), 4, profile, store_model="shared",
                    reference=hit_ratio_reference(prefix_trace, 4 * 80), cache_view="kv_events")
    result = replay.run()
    assert result.summary.transfer_tokens > 0  # engines still load from the pool
    replay.events.deliver_until(math.inf)
    keys = {k for r in prefix_trace for k in replay.scheduler.block_keys(replay.blocks(r))}
    for inst in replay.instances:
        endpoint = inst.config.kvs_endpoints[0]
        held = {k for k in keys if endpoint in replay.index.holders(k)}
        assert held == set(inst.engine.cache.keys()) and len(held) <= 10


def test_lagging_events_cost_cache_aware_routing_its_hits(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=40)

    def hit_ratio(**view) -> float:
        return simulate(prefix_trace, settings("cache_aware"), 4, profile, store_model="local",
                        **view).summary.prefix_hit_ratio

    store = hit_ratio()
    fresh = hit_ratio(cache_view="kv_events", kv_events_lag_s=0.0)
    # Requests arrive every 0.25 s: a minute late, the gateway never sees a prefix anywhere.
    stale = hit_ratio(cache_view="kv_events", kv_events_lag_s=60.0)
    blind = simulate(prefix_trace, settings("least_load"), 4, profile, store_model="local").summary
    assert fresh == pytest.approx(store, abs=0.05)
    assert fresh > stale + 0.2
    assert stale == pytest.approx(blind.prefix_hit_ratio, abs=0.1)


def test_cli_routes_on_kv_events(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60))
    argv = ["simulate", "--trace", path, "--instances", "2", "--policy", "cache_aware", "--store-model", "local",
            "--cache-view", "kv_events", "--kv-events-lag-ms", "50"]
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["cache_view"] == "kv_events" and body["kv_events_lag_ms"] == 50 and body["requests"] == 60
    assert main(argv) == 0
    assert "routed on KV events 50 ms late" in capsys.readouterr().out
    assert main([*argv[:-1], "-1"]) == 2
    assert "--kv-events-lag-ms" in capsys.readouterr().err
