"""The TTFT model, its calibration, tiered hits, the conductor policy and the rejection filter."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from kvgate.config import InstanceConfig, InstanceRole, Settings
from kvgate.scheduler.calibration import MAX_FACTOR, MIN_FACTOR, Calibration
from kvgate.scheduler.hashing import BlockHash
from kvgate.scheduler.prefill_curve import PrefillCurve
from kvgate.scheduler.prefix import EndpointMap
from kvgate.scheduler.rejection import RejectionFilter
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.tiers import TieredHits, tiered_hits
from kvgate.scheduler.ttft import TTFTModel, TTFTProfile
from kvgate.scheduler.types import Candidate, InstanceLoad

CHUNK = 100
# A linear curve (1 ms per token) and round bandwidths keep the expected figures readable:
# 100 KB per token, network 100 MB/s (1 ms/token), disk 20 MB/s (5 ms/token).
LINEAR = ((1000, 1.0),)
PROFILE = dict(ttft_prefill_points=LINEAR, kv_bytes_per_token=100_000, kv_network_bandwidth_gb_s=0.1,
               kv_disk_bandwidth_gb_s=0.02, ttft_calibration=False, kvs_chunk_size=CHUNK,
               cache_aware_scheduling_min_tokens=0, dispatch_policy="conductor")


def instances(*ids: str) -> tuple[InstanceConfig, ...]:
    return tuple(InstanceConfig(id=i, url=f"http://127.0.0.{n + 2}:8000", model="m",
                                kvs_endpoints=(f"127.0.0.{n + 2}",)) for n, i in enumerate(ids))


def endpoint(instance_index: int) -> str:
    return f"127.0.0.{instance_index + 2}:17901"


def blocks(count: int) -> list[BlockHash]:
    return [BlockHash(f"h{i}", CHUNK, True) for i in range(count)]


def candidate(id_: str, queued_tokens: int = 0, requests: int = 0, waiting: int = 0) -> Candidate:
    return Candidate(id_, InstanceRole.NEUTRAL, InstanceLoad(requests, waiting, queued_tokens, 0.0))


# --- the curve ---


@pytest.mark.parametrize(
    ("points", "cached", "new", "expected"),
    [
        (((1000, 1.0),), 0, 500, 0.5),
        (((1000, 1.0),), 500, 500, 0.5),
        (((1000, 1.0), (2000, 3.0)), 0, 2000, 3.0),
        (((1000, 1.0), (2000, 3.0)), 1000, 1000, 2.0),  # the steeper segment: attention
        (((1000, 1.0), (2000, 3.0)), 2000, 1000, 2.0),  # the last slope continues
    ],
)
def test_prefill_curve_prices_a_chunk_by_the_curve_increase(points, cached, new, expected):
    assert PrefillCurve(points).chunk_s(cached, new) == pytest.approx(expected)


# --- tiered hits ---


def test_tiers_local_prefix_pool_prefix_and_cheapest_tier_per_instance():
    endpoint_map = EndpointMap.from_instances(instances("a", "b", "c"))
    memory = [(endpoint(0),), (endpoint(0),), (endpoint(1),), (), ()]
    disk = [(), (), (), ("*",), ()]
    hits = tiered_hits(blocks(5), memory, disk, endpoint_map, 450)
    assert hits.local == {"a": 200}
    assert hits.pool_tokens == 400  # blocks 0-3; block 4 is nowhere
    assert hits.transfer_tokens("a") == (100, 100)  # block 2 from b's segment, block 3 from disk
    assert hits.transfer_tokens("b") == (200, 100)  # blocks 0-1 from a; its own block 2 is free
    assert hits.transfer_tokens("c") == (300, 100)
    without_disk = tiered_hits(blocks(5), memory, None, endpoint_map, 450)
    assert without_disk.pool_tokens == 300 and without_disk.transfer_tokens("c") == (300, 0)


# --- the cost model (table-driven) ---


@pytest.mark.parametrize(
    ("memory", "queued", "threshold", "expected"),
    [
        # (memory replicas of 4 blocks, queued tokens on b, threshold) -> b's (queue, prefill, transfer, tokens)
        ([(), (), (), ()], 0, 1.0, (0.0, 0.4, 0.0, 0)),  # nothing anywhere: compute all 400
        ([(endpoint(0),)] * 4, 0, 1.0, (0.0, 0.001, 0.399, 399)),  # load a's 4 blocks but the last token
        ([(endpoint(0),)] * 4, 300, 1.0, (0.3, 0.001, 0.399, 399)),  # its queue priced on the same curve
        ([(endpoint(1),)] * 2 + [(endpoint(0),)] * 2, 0, 1.0, (0.0, 0.001, 0.199, 199)),  # own 2 + a's 2
        ([(endpoint(1),)] * 2 + [(endpoint(0),)] * 2, 0, 2.0, (0.0, 0.001, 0.199, 199)),  # 400 >= 2 x 200
        ([(endpoint(1),)] * 2 + [(endpoint(0),)] * 2, 0, 2.5, (0.0, 0.2, 0.0, 0)),  # not 2.5x: compute
    ],
)
def test_cost_model_terms(memory, queued, threshold, expected):
    settings = Settings(**PROFILE, kvcache_balancing_threshold=threshold)
    scheduler = Scheduler(settings, instances("a", "b"))
    decision = scheduler.decide(400, blocks(4), memory, [candidate("a"), candidate("b", queued)])
    b = decision.predictions["b"]
    assert (b.queue_s, b.prefill_s, b.transfer_s, b.transfer_tokens) == pytest.approx(expected, abs=1e-3)
    assert b.predicted_ttft_s == pytest.approx(b.queue_s + b.prefill_s + b.transfer_s)


def test_a_decode_batch_slows_every_prefill_step_it_shares():
    # Each chunked-prefill step also carries one token of every running decode (1 ms a sequence
    # here, context free): b decodes 50 requests, 50 ms more on each 100-token step, queued or its
    # own. Its segment's first block saves it the 0.1 s a pays to load that block over the network,
    # less than the 0.3 s its decodes add: a wins (blind to the decodes, the model chose b).
    settings = Settings(**PROFILE, decode_step_s=(0.01, 0.001, 0.0), prefill_chunk_tokens=100)
    scheduler = Scheduler(settings, instances("a", "b"))
    decoding = candidate("b", queued_tokens=300, requests=52, waiting=2)  # 2 of them await a first token
    held = [(endpoint(1),)] + [()] * 3
    decision = scheduler.decide(400, blocks(4), held, [candidate("a", queued_tokens=300), decoding])
    a, b = decision.predictions["a"], decision.predictions["b"]
    assert (a.queue_s, a.prefill_s, a.transfer_s) == pytest.approx((0.3, 0.3, 0.1))
    assert b.local_hit_tokens == 100 and b.transfer_s == 0
    assert (b.queue_s, b.prefill_s) == pytest.approx((0.3 + 3 * 0.05, 0.3 + 3 * 0.05))
    assert decision.selected == "a"


def test_disk_tier_changes_routing_only_when_asked_for():
    # Block 0-2 on shared disk only; a has a long queue, b is idle but further from nothing.
    memory, disk = [()] * 3, [("*",)] * 3
    for flag, expected_transfer in ((False, 0), (True, 299)):
        settings = Settings(**PROFILE, kvs_query_disk_tier=flag)
        decision = Scheduler(settings, instances("a", "b")).decide(
            300, blocks(3), memory, [candidate("a"), candidate("b")], disk_locations=disk)
        assert decision.predictions["b"].transfer_tokens == expected_transfer
        # disk (5 ms/token) is dearer than computing (1 ms/token) here, so the disk tier only adds cost.
        expected = 0.299 * 5 + 0.001 if flag else 0.3
        assert decision.predictions["b"].predicted_ttft_s == pytest.approx(expected, abs=1e-3)


# --- the conductor policy ---


@pytest.mark.parametrize("queued", [0, 100, 398, 400, 402, 1000])
def test_conductor_chooses_the_non_holder_exactly_when_the_holders_queue_outweighs_transfer_plus_prefill(queued):
    # a holds the whole 400-token prefix; b holds nothing and would load it (399 tokens at 1 ms)
    # and compute the last token (1 ms): b's TTFT is 0.4 s, a's is its queue + 1 ms.
    settings = Settings(**PROFILE)
    scheduler = Scheduler(settings, instances("a", "b"))
    decision = scheduler.decide(400, blocks(4), [(endpoint(0),)] * 4, [candidate("a", queued), candidate("b")])
    a, b = decision.predictions["a"], decision.predictions["b"]
    assert a.queue_s == pytest.approx(queued / 1000) and b.transfer_s + b.prefill_s == pytest.approx(0.4)
    holder_slower = a.queue_s > b.transfer_s + b.prefill_s - a.prefill_s
    assert decision.selected == ("b" if holder_slower else "a")


def test_conductor_ties_fall_to_the_load_metrics_then_the_rotating_cursor():
    settings = Settings(**PROFILE)
    scheduler = Scheduler(settings, instances("a", "b", "c"))
    loads = [candidate("a", requests=3), candidate("b", requests=1), candidate("c", requests=1)]
    picks = [scheduler.decide(100, blocks(1), [()], loads).selected for _ in range(3)]
    assert picks == ["b", "c", "b"]  # equal predictions: fewer requests, then rotation among b and c


# --- calibration ---


@pytest.mark.parametrize(
    ("compute_s", "transfer_s", "measured_s", "compute_moves", "transfer_moves"),
    [
        (1.0, 0.0, 2.0, "up", "still"),  # all compute: only the compute factor learns
        (1.0, 0.0, 0.5, "down", "still"),
        (0.5, 0.5, 2.0, "up", "up"),  # shared in proportion to the terms
        (0.0, 1.0, 0.5, "still", "down"),
        (1.0, 0.0, 1.0, "still", "still"),  # exact: nothing to learn
    ],
)
def test_calibration_moves_each_factor_by_its_share(compute_s, transfer_s, measured_s, compute_moves,
                                                      transfer_moves):
    calibration = Calibration()
    calibration.observe("a", compute_s, transfer_s, measured_s)
    compute, transfer = calibration.factors("a")
    for factor, moves in ((compute, compute_moves), (transfer, transfer_moves)):
        assert {"up": factor > 1, "down": factor < 1, "still": factor == pytest.approx(1.0)}[moves]
    assert calibration.factors("other") == (1.0, 1.0)


def test_calibration_converges_on_a_wrong_profile_and_shrugs_off_outliers():
    calibration = Calibration()
    for _ in range(200):  # the engine is 3x slower than profiled
        calibration.observe("a", 1.0, 0.0, 3.0)
    assert calibration.factors("a")[0] == pytest.approx(3.0, rel=0.05)
    calibration.observe("a", 1.0, 0.0, 1000.0)  # one pathological measurement
    assert calibration.factors("a")[0] < 3.0 * 1.08
    for measured in (1e9, 1e-9, -1.0, math.nan, math.inf):
        for _ in range(500):
            calibration.observe("b", 1.0, 0.0, measured)
        assert MIN_FACTOR <= calibration.factors("b")[0] <= MAX_FACTOR


def test_calibrated_factors_scale_the_prediction():
    model = TTFTModel(TTFTProfile.from_settings(Settings(**PROFILE)))
    before = model.predict(candidate("a"), 500, TieredHits.empty())
    for _ in range(100):
        model.observe_ttft(model.predict(candidate("a"), 500, TieredHits.empty()), 1.0)
    after = model.predict(candidate("a"), 500, TieredHits.empty())
    assert before.predicted_ttft_s == pytest.approx(0.5)
    assert after.predicted_ttft_s == pytest.approx(1.0, rel=0.05)
    assert after.raw_compute_s == pytest.approx(0.5)


# --- the rejection filter ---


@pytest.mark.parametrize(
    ("mode", "requests", "waiting", "ttft_s", "rejected"),
    [
        ("none", 100, 0, 10.0, None),
        ("early", 1, 0, 0.05, None),
        ("early", 1, 0, 0.5, "ttft_slo_exceeded"),
        ("early", 30, 0, 0.05, "tbt_slo_exceeded"),  # 30 decoding now: over the TBT SLO
        ("predictive", 30, 0, 0.05, "tbt_slo_exceeded"),  # most still decoding 50 ms later
        ("early", 10, 0, 0.05, None),  # 11 sequences: 21 ms
        ("early", 10, 5, 0.05, "tbt_slo_exceeded"),  # + a 20 ms prefill chunk while 5 wait
        ("predictive", 10, 5, 0.05, None),  # those 5 are done first and join: 16 sequences, 26 ms
        ("predictive", 10, 20, 0.05, "tbt_slo_exceeded"),  # 20 join: 31 sequences
    ],
)
def test_rejection_filter(mode, requests, waiting, ttft_s, rejected):
    # Decode step 10 ms + 1 ms per sequence, a 20-token prefill chunk 20 ms; SLOs: TTFT 0.1 s, TBT 35 ms.
    settings = Settings(**PROFILE, decode_step_s=(0.01, 0.001, 0.0), prefill_chunk_tokens=20)
    model = TTFTModel(TTFTProfile.from_settings(settings))
    model.mean_output_tokens = 1000  # ~25 s decodes: few leave within a TTFT
    prediction = replace(model.predict(candidate("a"), 10, TieredHits.empty()), predicted_ttft_s=ttft_s)
    verdict = RejectionFilter(mode, 0.1, 0.035).judge(prediction, InstanceLoad(requests + waiting, waiting, 0, 0), model)
    assert (verdict.code if verdict else None) == rejected
    if verdict:
        assert verdict.retry_after_s >= 1 and "SLO" in verdict.message


def test_predictive_rejection_lets_requests_leave_before_this_one_decodes():
    settings = Settings(**PROFILE, decode_step_s=(0.01, 0.001, 0.0))
    model = TTFTModel(TTFTProfile.from_settings(settings))
    model.mean_output_tokens = 10  # decodes of ~0.4 s at 30 sequences
    load = InstanceLoad(30, 0, 0, 0.0)
    early = RejectionFilter("early", 0.0, 0.035).decode_outlook(0.3, load, model)
    predictive = RejectionFilter("predictive", 0.0, 0.035).decode_outlook(0.3, load, model)
    assert early.batch == 31 and predictive.batch < 10
