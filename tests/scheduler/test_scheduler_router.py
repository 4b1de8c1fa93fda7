"""Scheduler: hashing, keys, hits and policy wired from the settings, as the gateway uses them."""

from __future__ import annotations

from kvgate.config import InstanceConfig, InstanceRole, Settings
from kvgate.scheduler import Candidate, InstanceLoad, Scheduler


def instance(id_: str, *endpoints: str) -> InstanceConfig:
    return InstanceConfig(id=id_, url="http://127.0.0.1:9000", model="m", kvs_endpoints=endpoints)


def idle(*ids: str) -> list[Candidate]:
    return [Candidate(i, InstanceRole.NEUTRAL, InstanceLoad()) for i in ids]


INSTANCES = [instance("a", "127.0.0.2"), instance("b", "127.0.0.3:17901")]


def test_block_hashes_and_keys_follow_the_settings():
    scheduler = Scheduler(Settings(kvs_chunk_size=4, kvs_enable_save_unfull_chunk=True), INSTANCES)
    blocks = scheduler.block_hashes([1, 2, 3, 4, 5])
    assert scheduler.block_keys(blocks) == [
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb_0",
        "105474563044be49e8741387f67df29d2f9eb696528c310bda92aa1ce554cee6_0",
    ]
    seeded = Scheduler(Settings(kvs_chunk_size=4, hash_seed="seed-1"), INSTANCES)
    assert seeded.block_keys(seeded.block_hashes([1, 2, 3, 4, 5])) == [
        "cd5274edd02cd2be740010d36770ca489dbf581625cf482bce3e1d08c671787b_0"
    ]


def test_wants_kvs_only_for_cache_policies_and_long_prompts():
    assert Scheduler(Settings(dispatch_policy="cache_aware"), INSTANCES).wants_kvs(1024)
    assert not Scheduler(Settings(dispatch_policy="cache_aware"), INSTANCES).wants_kvs(1023)
    assert Scheduler(Settings(dispatch_policy="prefix"), INSTANCES).wants_kvs(5000)
    assert Scheduler(Settings(enable_cache_aware_scheduling=True), INSTANCES).wants_kvs(5000)
    assert not Scheduler(Settings(), INSTANCES).wants_kvs(5000)
    assert not Scheduler(Settings(dispatch_policy="round_robin"), INSTANCES).wants_kvs(5000)


def test_decide_turns_store_locations_into_hits():
    scheduler = Scheduler(Settings(dispatch_policy="cache_aware", kvs_chunk_size=256), INSTANCES)
    tokens = list(range(1024))
    blocks = scheduler.block_hashes(tokens)
    locations = [{"127.0.0.3:17901", "127.0.0.2:1"}, {"127.0.0.3:17901"}, {"127.0.0.3:17901"}, set()]
    decision = scheduler.decide(len(tokens), blocks, locations, idle("a", "b"))
    assert decision.ranking == ("b", "a") and decision.cache_aware
    assert [(s.id, s.prefix_hit_tokens) for s in decision.scores] == [("b", 768), ("a", 256)]


def test_no_store_answer_means_no_hits():
    scheduler = Scheduler(Settings(dispatch_policy="cache_aware", kvs_chunk_size=256), INSTANCES)
    blocks = scheduler.block_hashes(list(range(1024)))
    decision = scheduler.decide(1024, blocks, None, idle("a", "b"))
    assert all(s.prefix_hit_tokens == 0 and s.prefix_miss_tokens == 1024 for s in decision.scores)


def test_set_instances_rebuilds_the_endpoint_map():
    scheduler = Scheduler(Settings(dispatch_policy="prefix", kvs_chunk_size=256), INSTANCES)
    blocks = scheduler.block_hashes(list(range(1024)))
    locations = [{"127.0.0.9:1"}] * 4
    assert scheduler.decide(1024, blocks, locations, idle("a", "c")).scores[0].prefix_hit_tokens == 0
    scheduler.set_instances([*INSTANCES, instance("c", "127.0.0.9")])
    decision = scheduler.decide(1024, blocks, locations, idle("a", "c"))
    assert decision.selected == "c" and decision.scores[0].prefix_hit_tokens == 1024
