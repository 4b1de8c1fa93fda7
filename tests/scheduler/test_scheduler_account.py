"""The load account: every path returns to zero, staleness, retries, and the merge with engine stats."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kvgate.config import InstanceRole, Settings
from kvgate.scheduler.account import EngineStats, LoadAccount
from kvgate.scheduler.registry import make_policy
from kvgate.scheduler.types import Candidate, InstanceLoad, RoutingRequest


def assert_empty(account: LoadAccount, *instances: str) -> None:
    assert account.total_inflight() == 0
    for instance in instances:
        assert account.inflight(instance) == (0, 0)
        assert account.load(instance) == InstanceLoad()


def test_finish_path():
    account = LoadAccount(10)
    account.dispatch("r1", "a", 300, now=0)
    assert account.inflight("a") == (1, 300)
    assert account.load("a") == InstanceLoad(
        num_requests=1, num_waiting_requests=1, all_prefills_tokens_num=300
    )
    account.first_token("r1", now=1)
    assert account.inflight("a") == (1, 0)
    assert account.load("a") == InstanceLoad(num_requests=1)
    account.release("r1")
    assert_empty(account, "a")


def test_error_before_first_token_and_repeated_release():
    account = LoadAccount(10)
    account.dispatch("r1", "a", 300, now=0)
    account.release("r1")
    account.release("r1")
    account.release("never-seen")
    account.first_token("never-seen", now=1)
    assert_empty(account, "a")


def test_retry_moves_the_request():
    account = LoadAccount(10)
    account.dispatch("r1", "a", 300, now=0)
    account.dispatch("r1", "b", 200, now=1)
    assert account.inflight("a") == (0, 0) and account.inflight("b") == (1, 200)
    assert account.total_inflight() == 1
    account.first_token("r1", now=2)
    account.first_token("r1", now=3)  # a second first token changes nothing
    assert account.inflight("b") == (1, 0)
    account.release("r1")
    assert_empty(account, "a", "b")


def test_staleness_counts_from_the_last_update():
    account = LoadAccount(10)
    account.dispatch("old", "a", 100, now=0)
    account.dispatch("streaming", "a", 100, now=0)
    account.first_token("streaming", now=8)
    account.dispatch("new", "b", 100, now=5)
    assert account.expire(now=10) == []
    assert account.expire(now=10.5) == ["old"]
    assert account.inflight("a") == (1, 0)
    assert sorted(account.expire(now=18.5)) == ["new", "streaming"]
    account.release("old")  # the owner's late release is a no-op
    assert_empty(account, "a", "b")


def test_engine_stats_merge_with_the_account():
    account = LoadAccount(10)
    account.observe_engine("a", EngineStats(num_running=4, num_waiting=2, kv_cache_usage_ratio=0.5), now=0)
    assert account.load("a") == InstanceLoad(6, 2, 0, 0.5)
    for n in range(8):  # more in flight than the engine has seen yet
        account.dispatch(f"r{n}", "a", 10, now=1)
    account.first_token("r0", now=1)
    assert account.load("a") == InstanceLoad(
        num_requests=8, num_waiting_requests=7, all_prefills_tokens_num=70, kv_cache_usage_ratio=0.5
    )
    # Engine reports expire like requests do; the account alone remains.
    account.expire(now=10.5)
    assert account.load("a") == InstanceLoad(
        num_requests=8, num_waiting_requests=7, all_prefills_tokens_num=70
    )


def test_concurrent_decisions_see_each_others_dispatches():
    account = LoadAccount(10)
    policy = make_policy(Settings(dispatch_policy="cache_aware"))
    request = RoutingRequest(4096, {"a": 4096, "b": 4096})
    picks = []
    for n in range(4):
        candidates = [Candidate(i, InstanceRole.NEUTRAL, account.load(i)) for i in ("a", "b")]
        decision = policy.select(request, candidates)
        picks.append(decision.selected)
        account.dispatch(f"r{n}", decision.selected, decision.scores[0].prefix_miss_tokens + 100, now=0)
    assert sorted(picks) == ["a", "a", "b", "b"]


operations = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "first_token", "release", "expire"]),
        st.sampled_from(["r1", "r2", "r3", "r4"]),
        st.sampled_from(["a", "b", "c"]),
        st.integers(0, 500),
    ),
    max_size=40,
)


@given(operations)
def test_any_sequence_of_events_adds_up_and_returns_to_zero(ops):
    account = LoadAccount(5)
    model: dict[str, tuple[str, int, bool]] = {}  # request -> (instance, tokens, awaiting first token)
    now = 0.0
    for op, request, instance, tokens in ops:
        now += 1
        if op == "dispatch":
            account.dispatch(request, instance, tokens, now)
            model[request] = (instance, tokens, True)
        elif op == "first_token":
            account.first_token(request, now)
            if request in model:
                model[request] = (*model[request][:2], False)
        elif op == "release":
            account.release(request)
            model.pop(request, None)
        else:
            for expired in account.expire(now + 100):
                model.pop(expired)
            assert model == {}
        for inst in ("a", "b", "c"):
            mine = [v for v in model.values() if v[0] == inst]
            assert account.inflight(inst) == (len(mine), sum(t for _, t, awaiting in mine if awaiting))
        assert account.total_inflight() == len(model)
    for request in list(model):
        account.release(request)
    assert_empty(account, "a", "b", "c")
