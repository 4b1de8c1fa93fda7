"""`kvgate simulate --kvs-backend kv_events`: the gateway routes on each instance's own cache as its KV
events report it, late; the same scheduler code runs as with the store's index."""

from __future__ import annotations

import json
import math
import random

import pytest

from kvgate.cli import main
from kvgate.kvs_client.embedded import EmbeddedKVSIndex
from kvgate.simulator.kv_events_view import KVEventsView
from kvgate.simulator.profile import trace_profile
from kvgate.simulator.replay import Replay, hit_ratio_reference, simulate
from kvgate.simulator.trace import read_trace
from tests.simulator.test_simulator import prefix_heavy_rows, settings
from tests.trace_helpers import row, write_trace


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
    replay = Replay(prefix_trace, settings("cache_aware", kvs_backend="kv_events"), 4, profile, store_model="local",
                    reference=hit_ratio_reference(prefix_trace, 4 * 40), kv_events_lag_s=0.2)
    replay.run()
    assert replay.account.total_inflight() == 0
    replay.events.deliver_until(math.inf)
    keys = {k for r in prefix_trace for k in replay.scheduler.block_keys(replay.blocks(r))}
    for inst in replay.instances:
        endpoint = inst.config.kvs_endpoints[0]
        assert {k for k in keys if endpoint in replay.events.index.holders(k)} == set(inst.engine.cache.keys())


def test_with_a_shared_store_the_events_index_holds_hbm_only(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=80)  # 10 HBM blocks per instance, 70 in its segment
    replay = Replay(prefix_trace, settings("round_robin", kvs_backend="kv_events"), 4, profile, store_model="shared",
                    reference=hit_ratio_reference(prefix_trace, 4 * 80))
    result = replay.run()
    assert result.summary.transfer_tokens > 0  # engines still load from the pool
    replay.events.deliver_until(math.inf)
    keys = {k for r in prefix_trace for k in replay.scheduler.block_keys(replay.blocks(r))}
    for inst in replay.instances:
        endpoint = inst.config.kvs_endpoints[0]
        held = {k for k in keys if endpoint in replay.events.index.holders(k)}
        assert held == set(inst.engine.cache.keys()) and len(held) <= 10


def test_lagging_events_cost_cache_aware_routing_its_hits(prefix_trace):
    profile = trace_profile(cache_capacity_blocks=40)

    def hit_ratio(backend: str = "mooncake", lag_s: float = 0.0) -> float:
        return simulate(prefix_trace, settings("cache_aware", kvs_backend=backend), 4, profile, store_model="local",
                        kv_events_lag_s=lag_s).summary.prefix_hit_ratio

    store = hit_ratio()
    fresh = hit_ratio("kv_events", 0.0)
    # Requests arrive every 0.25 s: a minute late, the gateway never sees a prefix anywhere.
    stale = hit_ratio("kv_events", 60.0)
    blind = simulate(prefix_trace, settings("least_load"), 4, profile, store_model="local").summary
    assert fresh == pytest.approx(store, abs=0.05)
    assert fresh > stale + 0.2
    assert stale == pytest.approx(blind.prefix_hit_ratio, abs=0.1)


def test_cli_routes_on_kv_events(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60))
    argv = ["simulate", "--trace", path, "--instances", "2", "--policy", "cache_aware", "--store-model", "local",
            "--kvs-backend", "kv_events", "--kv-events-lag-ms", "50"]
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["kvs_backend"] == "kv_events" and body["kv_events_lag_ms"] == 50 and body["requests"] == 60
    assert main(argv) == 0
    assert "routed on KV events 50 ms late" in capsys.readouterr().out
    assert main([*argv[:-1], "-1"]) == 2
    assert "--kv-events-lag-ms" in capsys.readouterr().err


def test_kv_events_backend_reads_engine_prefixes_as_the_gateway_does(prefix_trace):
    # With a shared store the engines still load other segments' blocks, but a gateway on KV events
    # asks no store: it sees each instance's own prefix and prices no transfer from another one (a gateway
    # on the store prices, for the instances that do not hold a prompt's prefix, loading it from the holder).
    profile = trace_profile(cache_capacity_blocks=80)

    def transfers_planned(backend: str) -> tuple[int, list]:
        replay = Replay(prefix_trace, settings("conductor", kvs_backend=backend), 4, profile, store_model="shared",
                        reference=hit_ratio_reference(prefix_trace, 4 * 80))
        calls, decide = [], replay.scheduler.decide

        def recording_decide(n, blocks, locations, candidates, **kwargs):
            decision = decide(n, blocks, locations, candidates, **kwargs)
            calls.append((locations, kwargs.get("engine")))
            # Every candidate's price, not only the winner's: conductor may well prefer the holder.
            replay.planned += sum(prediction.transfer_tokens for prediction in decision.predictions.values())
            return decision

        replay.planned = 0
        replay.scheduler.decide = recording_decide
        replay.run()
        return replay.planned, calls

    planned, calls = transfers_planned("kv_events")
    assert planned == 0
    assert all(locations is None for locations, _ in calls)
    assert sum(bool(engine.prefixes) for _, engine in calls) > len(calls) // 5  # 10 HBM blocks: ~1 document
    planned, calls = transfers_planned("mooncake")
    assert planned > 0 and all(engine is None for _, engine in calls)


def test_cli_kv_events_backend_is_for_neutral_fleets(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(20))
    assert main(["simulate", "--trace", path, "--kvs-backend", "kv_events", "--prefill-instances", "1",
                 "--decode-instances", "1"]) == 2
    assert "replay neutral instances only" in capsys.readouterr().err
    assert main(["simulate", "--trace", path, "--instances", "2", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["kvs_backend"] == "mooncake" and "kv_events_lag_ms" not in body


def test_events_beside_the_store_add_each_engine_s_own_prefix_to_the_store_s_view(tmp_path):
    # Four 32-block documents asked every 40 ms: busy holders make others load them from their
    # segments into HBM. The pool stores a block once, so the store alone sees those instances hold
    # nothing of their own (a transfer to price); the events beside it say their engines hold it.
    pick = random.Random(1)
    rows = [row(i * 40, [1000 * pick.randrange(4) + b for b in range(32)] + [10**6 + i], output_length=30)
            for i in range(200)]
    trace = read_trace(write_trace(tmp_path / "busy.jsonl", rows))
    profile = trace_profile(cache_capacity_blocks=320)  # 40 HBM blocks per instance
    replay = Replay(trace, settings("conductor"), 4, profile, store_model="shared",
                    reference=hit_ratio_reference(trace, 4 * 320), kv_events_lag_s=0.01, engine_events=True)
    calls, decide = [], replay.scheduler.decide

    def recording_decide(n, blocks, locations, candidates, **kwargs):
        engine = kwargs.get("engine")
        calls.append((locations, engine, replay.scheduler.store_hits(n, blocks, locations)))
        return decide(n, blocks, locations, candidates, **kwargs)

    replay.scheduler.decide = recording_decide
    result = replay.run()
    assert replay.account.total_inflight() == 0 and result.summary.transfer_tokens > 0
    assert len(calls) == 200 and all(locations is not None and engine is not None for locations, engine, _ in calls)
    engine_longer = sum(
        any(prefix.tokens > store.get(instance_id, 0) for instance_id, prefix in engine.prefixes.items())
        for _, engine, store in calls
    )
    assert engine_longer > len(calls) // 5
    # The two indexes stay apart: the store's holds the segments, the events' each engine's HBM.
    replay.events.deliver_until(math.inf)
    keys = {k for r in trace for k in replay.scheduler.block_keys(replay.blocks(r))}
    for slot, inst in enumerate(replay.instances):
        endpoint = inst.config.kvs_endpoints[0]
        assert {k for k in keys if endpoint in replay.events.index.holders(k)} == set(inst.engine.cache.keys())
        assert {k for k in keys if endpoint in replay.index.holders(k)} == {
            k for k in keys if replay.store.holder(k) == slot}


def test_cli_routes_on_kv_events_beside_the_store(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60))
    argv = ["simulate", "--trace", path, "--instances", "2", "--policy", "conductor", "--kv-events-beside-store",
            "--kv-events-lag-ms", "20"]
    assert main([*argv, "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert body["cache_view"] == "store+kv_events" and body["kvs_backend"] == "mooncake"
    assert body["kv_events_lag_ms"] == 20 and body["requests"] == 60
    assert main(argv) == 0
    assert "routed on KV events 20 ms late beside the store" in capsys.readouterr().out
    assert main([*argv, "--kvs-backend", "kv_events"]) == 2
    assert "--kv-events-beside-store needs a store backend" in capsys.readouterr().err
    assert main([*argv, "--prefill-instances", "1", "--decode-instances", "1"]) == 2
    assert "neutral instances only" in capsys.readouterr().err
