"""The engines' view in the pure scheduler: merged with the store's, priced by tier in the TTFT model."""

from __future__ import annotations

from kvgate.config.settings import InstanceConfig, InstanceRole, Settings
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.tiers import EngineHits, EnginePrefix
from kvgate.scheduler.types import Candidate, InstanceLoad

CHUNK = 16
PROMPT = list(range(10 * CHUNK + 5))


def scheduler(**overrides) -> Scheduler:
    instances = tuple(InstanceConfig(id=f"e{i}", url=f"http://127.0.0.1:{9000 + i}", model="m",
                                     kvs_endpoints=(f"127.0.0.{i + 2}",)) for i in range(3))
    settings = Settings(kvs_chunk_size=CHUNK, cache_aware_scheduling_min_tokens=CHUNK, instances=instances,
                        **overrides)
    return Scheduler(settings, instances)


def candidates() -> list[Candidate]:
    return [Candidate(f"e{i}", InstanceRole.NEUTRAL, InstanceLoad()) for i in range(3)]


def test_events_alone_give_hits_without_a_store_answer():
    sched = scheduler(dispatch_policy="cache_aware")
    blocks = sched.block_hashes(PROMPT)
    engine = EngineHits({"e2": EnginePrefix(6 * CHUNK)}, frozenset({"e1"}))
    decision = sched.decide(len(PROMPT), blocks, None, candidates(), engine=engine)
    assert decision.selected == "e2"
    assert {s.id: s.prefix_hit_tokens for s in decision.scores} == {"e0": 0, "e1": 0, "e2": 6 * CHUNK}
    # No events and no store answer: load only, as before.
    assert {s.prefix_hit_tokens for s in sched.decide(len(PROMPT), blocks, None, candidates()).scores} == {0}


def test_the_longer_of_store_segment_and_engine_is_the_local_prefix():
    sched = scheduler(dispatch_policy="cache_aware")
    blocks = sched.block_hashes(PROMPT)
    # The store: e0's segment holds 4 blocks; e1's engine holds 2 blocks (and e0's engine 7).
    locations = [("127.0.0.2:1",)] * 4 + [()] * 6
    engine = EngineHits({"e1": EnginePrefix(2 * CHUNK), "e0": EnginePrefix(3 * CHUNK, 4 * CHUNK)})
    decision = sched.decide(len(PROMPT), blocks, locations, candidates(), engine=engine)
    assert {s.id: s.prefix_hit_tokens for s in decision.scores} == {"e0": 7 * CHUNK, "e1": 2 * CHUNK, "e2": 0}
    assert sched.store_hits(len(PROMPT), blocks, locations) == {"e0": 4 * CHUNK}


def test_a_cpu_tier_prefix_costs_a_host_load_and_gpu_is_free():
    sched = scheduler(dispatch_policy="conductor", kv_bytes_per_token=1_000_000, kv_host_bandwidth_gb_s=1.0)
    blocks = sched.block_hashes(PROMPT)
    engine = EngineHits({"e0": EnginePrefix(8 * CHUNK), "e1": EnginePrefix(0, 8 * CHUNK),
                         "e2": EnginePrefix(0, 0, 8 * CHUNK)})
    decision = sched.decide(len(PROMPT), blocks, None, candidates(), engine=engine)
    predictions = decision.predictions
    assert predictions is not None
    gpu, cpu, disk = (predictions[f"e{i}"] for i in range(3))
    assert (gpu.transfer_tokens, gpu.transfer_s) == (0, 0.0)
    assert cpu.transfer_tokens == 8 * CHUNK
    assert abs(cpu.transfer_s - 8 * CHUNK * 1_000_000 / 1e9) < 1e-9  # 1 GB/s host link
    assert abs(disk.transfer_s - 8 * CHUNK * 1_000_000 / 5e9) < 1e-9  # the disk tier's 5 GB/s
    assert decision.selected == "e0"
