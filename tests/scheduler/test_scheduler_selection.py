"""Metrics, selector and policies: order, cache-metric rules, ties, top-k, determinism."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import Settings
from kvgate.config.settings import InstanceRole
from kvgate.scheduler.registry import build_metrics, make_policy
from kvgate.scheduler.types import Candidate, Decision, InstanceLoad, RoutingRequest

METRICS = build_metrics(Settings(cache_aware_queued_tokens_weight=1.0))  # Llumnix's weight
NEUTRAL, PREFILL, DECODE = InstanceRole.NEUTRAL, InstanceRole.PREFILL, InstanceRole.DECODE


def cand(id_, requests=0, waiting=0, prefills=0, usage=0.0, role=NEUTRAL) -> Candidate:
    return Candidate(id_, role, InstanceLoad(requests, waiting, prefills, usage))


def policy(name="least_load", **fields):
    return make_policy(Settings(dispatch_policy=name, **fields))


def test_metric_order_first_strict_difference_decides():
    a, b = cand("a", requests=1, waiting=5), cand("b", requests=2, waiting=0)
    request = RoutingRequest(10)
    by_requests = policy(dispatch_metric_order="num_requests,num_waiting_requests")
    by_waiting = policy(dispatch_metric_order="num_waiting_requests,num_requests")
    assert by_requests.select(request, [a, b]).ranking == ("a", "b")
    assert by_waiting.select(request, [a, b]).ranking == ("b", "a")


def test_ties_fall_through_to_the_next_metric():
    a, b = cand("a", requests=3, usage=0.9), cand("b", requests=3, usage=0.1)
    decision = policy(dispatch_metric_order="num_requests,kv_cache_usage_ratio").select(
        RoutingRequest(10), [a, b]
    )
    assert decision.selected == "b"


def test_default_order_puts_queued_prefill_tokens_first():
    a, b = cand("a", requests=9, prefills=100), cand("b", requests=0, prefills=5000)
    assert policy().select(RoutingRequest(10), [a, b]).selected == "a"


def test_cache_aware_prepends_miss_plus_queue_for_long_prompts():
    # a holds half the prompt but has queued work; b holds nothing and is idle.
    a, b = cand("a", prefills=1000), cand("b")
    long_prompt = RoutingRequest(4096, {"a": 2048})
    cache_aware = policy("cache_aware")
    decision = cache_aware.select(long_prompt, [a, b])
    assert decision.selected == "a" and decision.cache_aware
    # Queued tokens weigh --cache-aware-queued-tokens-weight (default 0.5) each.
    assert decision.scores[0].metrics["cache_aware_all_prefills_tokens_num"] == 2048 + 0.5 * 1000
    # b has no hit: its miss is the whole prompt (Llumnix would say 0 and prefer it).
    assert decision.scores[1].prefix_miss_tokens == 4096
    assert decision.scores[1].metrics["cache_aware_all_prefills_tokens_num"] == 4096


def test_queued_tokens_weight_decides_between_prefix_holder_and_idle_instance():
    # a holds 1024 of 4096 tokens behind 2000 queued ones; b holds nothing and is idle.
    a, b = cand("a", prefills=2000), cand("b")
    request = RoutingRequest(4096, {"a": 1024})
    # Llumnix's weight 1: a costs 3072 + 2000 = 5072 > b's 4096.
    assert policy("cache_aware", cache_aware_queued_tokens_weight=1.0).select(request, [a, b]).selected == "b"
    # Default 0.5: a costs 3072 + 1000 = 4072 < 4096, so the holder keeps the conversation.
    assert policy("cache_aware").select(request, [a, b]).selected == "a"


def test_cache_metric_needs_min_tokens():
    a, b = cand("a", prefills=100), cand("b")
    short = RoutingRequest(1023, {"a": 512})
    decision = policy("cache_aware").select(short, [a, b])
    assert decision.selected == "b" and not decision.cache_aware
    lowered = policy("cache_aware", cache_aware_scheduling_min_tokens=512).select(short, [a, b])
    assert lowered.selected == "a" and lowered.cache_aware


def test_cache_metric_not_used_for_decode_candidates():
    a, b = cand("a", prefills=1000, role=DECODE), cand("b", role=DECODE)
    decision = policy("cache_aware").select(RoutingRequest(4096, {"a": 4096}), [a, b])
    assert decision.selected == "b" and not decision.cache_aware
    prefill = policy("cache_aware").select(
        RoutingRequest(4096, {"a": 4096}), [cand("a", prefills=1000, role=PREFILL), cand("b", role=PREFILL)]
    )
    assert prefill.selected == "a" and prefill.cache_aware


def test_llumnix_switch_turns_least_load_into_cache_aware():
    switched = policy(enable_cache_aware_scheduling=True)
    assert switched.name == "cache_aware"
    assert (
        switched.select(RoutingRequest(4096, {"a": 4096}), [cand("a", prefills=1), cand("b")]).selected == "a"
    )


def test_prefix_policy_prefers_the_longest_hit_then_load():
    a, b, c = cand("a", requests=50), cand("b", requests=1), cand("c", requests=0)
    decision = policy("prefix").select(RoutingRequest(4096, {"a": 3072, "b": 1024}), [c, b, a])
    assert decision.ranking == ("a", "b", "c") and decision.cache_aware
    assert decision.scores[0].metrics["kv_cache_hit_len"] == 3072


def test_least_load_ignores_hits():
    decision = policy().select(RoutingRequest(4096, {"a": 4096}), [cand("a", prefills=10), cand("b")])
    assert decision.selected == "b" and not decision.cache_aware


def test_round_robin_rotates_over_ids_whatever_the_load():
    rr = policy("round_robin")
    candidates = [cand("c", requests=9), cand("a"), cand("b", prefills=99)]
    picks = [rr.select(RoutingRequest(10), candidates).selected for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_empty_candidates():
    assert policy("cache_aware").select(RoutingRequest(4096), []) == Decision(None, (), (), False)


def test_full_ties_spread_evenly_over_many_decisions():
    least_load = policy()
    candidates = [cand(f"i{n}") for n in range(7)]
    picks = Counter(least_load.select(RoutingRequest(2000), candidates).selected for _ in range(700))
    assert picks == {f"i{n}": 100 for n in range(7)}


def test_tie_rotation_skips_a_loaded_instance_and_wraps():
    least_load = policy()
    decisions = [
        least_load.select(RoutingRequest(10), [cand("a"), cand("b", requests=1), cand("c")]).selected
        for _ in range(4)
    ]
    assert decisions == ["a", "c", "a", "c"]


def test_top_k_picks_among_the_k_best_only():
    top2 = make_policy(Settings(dispatch_top_k=2), rng=random.Random(5))
    candidates = [cand("a", prefills=1), cand("b", prefills=2), cand("c", prefills=3)]
    picks = Counter(top2.select(RoutingRequest(10), candidates).selected for _ in range(400))
    assert set(picks) == {"a", "b"} and min(picks.values()) > 120
    decision = top2.select(RoutingRequest(10), candidates)
    assert sorted(decision.ranking) == ["a", "b", "c"] and decision.ranking[-1] == "c"


def test_same_settings_and_seed_make_the_same_decisions():
    def run():
        p = make_policy(Settings(dispatch_top_k=3), rng=random.Random(11))
        r = random.Random(3)
        out = []
        for _ in range(50):
            candidates = [cand(f"i{n}", requests=r.randrange(3)) for n in range(6)]
            out.append(p.select(RoutingRequest(10), candidates).ranking)
        return out

    assert run() == run()


def test_scores_read_like_a_tuple():
    decision = policy("cache_aware").select(RoutingRequest(2048, {"b": 1024}), [cand("a"), cand("b")])
    scores = decision.scores
    assert len(scores) == 2 and [s.id for s in scores] == list(decision.ranking) == ["b", "a"]
    assert scores == tuple(scores) and scores[:1] == (scores[0],) and scores[-1].id == "a"
    assert (scores[0].prefix_hit_tokens, scores[0].prefix_miss_tokens) == (1024, 1024)
    assert list(scores[0].metrics) == [
        "cache_aware_all_prefills_tokens_num",
        *Settings().dispatch_metric_order,
    ]


def test_metric_value_equals_its_column():
    candidates = [cand("a", 1, 2, 3, 0.5), cand("b", 4, 5, 6, 0.25)]
    request = RoutingRequest(100, {"b": 40})
    for metric in METRICS.values():
        assert [metric.value(c, request) for c in candidates] == metric.values(candidates, request)
    assert METRICS["kv_cache_hit_len"].values(candidates, request) == [0, 40]
    assert METRICS["cache_aware_all_prefills_tokens_num"].values(candidates, request) == [103, 66]
    assert not METRICS["kv_cache_hit_len"].less and METRICS["num_requests"].less


loads = st.builds(
    InstanceLoad,
    st.integers(0, 3),
    st.integers(0, 2),
    st.integers(0, 3).map(lambda x: x * 256),
    st.sampled_from([0.0, 0.5]),
)


@given(
    st.lists(loads, min_size=1, max_size=12),
    st.dictionaries(st.integers(0, 11), st.integers(1, 8).map(lambda x: x * 256)),
    st.sampled_from(["least_load", "prefix", "cache_aware"]),
)
def test_ranking_is_sorted_by_the_metric_tuple(load_list, hit_map, name):
    candidates = [Candidate(f"i{n:02d}", NEUTRAL, load) for n, load in enumerate(load_list)]
    request = RoutingRequest(2048, {f"i{n:02d}": hit for n, hit in hit_map.items() if n < len(load_list)})
    decision = policy(name).select(request, candidates)
    names = list(decision.scores[0].metrics)
    signed = {
        s.id: tuple(s.metrics[m] * (1 if METRICS[m].less else -1) for m in names) for s in decision.scores
    }
    keys = [signed[i] for i in decision.ranking]
    assert keys == sorted(keys) and sorted(decision.ranking) == sorted(c.id for c in candidates)


@given(
    st.lists(loads, min_size=1, max_size=12),
    st.dictionaries(st.integers(0, 15), st.integers(1, 8).map(lambda x: x * 256)),
)
def test_longest_prefix_hit_is_the_best_score_without_building_them(load_list, hit_map):
    candidates = [Candidate(f"i{n:02d}", NEUTRAL, load) for n, load in enumerate(load_list)]
    # Hits may name instances that are not candidates (unroutable ones): they never count.
    request = RoutingRequest(2048, {f"i{n:02d}": hit for n, hit in hit_map.items()})
    scores = policy("cache_aware").select(request, candidates).scores
    longest = scores.longest_prefix_hit()
    assert longest == max(score.prefix_hit_tokens for score in scores)


def test_a_score_is_built_once_and_kept():
    decision = policy("cache_aware").select(RoutingRequest(2048, {"b": 1024}), [cand("a"), cand("b")])
    assert decision.scores[0] is decision.scores[0] and decision.scores[-1] is decision.scores[1]
    assert decision.scores[0] == decision.scores[:1][0] and decision.scores[1].id == "a"
