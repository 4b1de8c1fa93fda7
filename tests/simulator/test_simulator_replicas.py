"""Gateway replicas in the simulator: blind accounts, synced ones, and the bursts they are judged on."""

from __future__ import annotations

from kvgate.scheduler.types import EngineStats, InstanceLoad
from kvgate.simulator.replicas import GatewayReplicas, spread_bursts
from kvgate.simulator.trace import TraceRequest


def test_blind_replicas_see_only_their_own_dispatches():
    replicas = GatewayReplicas(2, staleness_s=600, sync_interval_s=None)
    replicas.dispatch("r1", "a", 100, now=0.0)  # replica 0
    replicas.sync_until(10.0)
    assert replicas.load("a") == InstanceLoad()  # replica 1 decides next and knows nothing
    replicas.observe_engine("a", EngineStats(1, 0, 0.2), now=10.0)  # but reads the engine, seconds late
    assert replicas.load("a") == InstanceLoad(1, 0, 0, 0.2)


def test_synced_replicas_see_each_other_within_two_intervals_and_drop_what_ended():
    replicas = GatewayReplicas(2, staleness_s=600, sync_interval_s=0.1)
    replicas.dispatch("r1", "a", 100, now=0.0)
    replicas.sync_until(0.0)
    assert replicas.load("a") == InstanceLoad()  # nothing published yet
    replicas.sync_until(0.2)  # replica 0 published at 0.1, replica 1 read at 0.15
    assert replicas.load("a") == InstanceLoad(1, 1, 100)
    replicas.first_token("r1", now=0.25)
    replicas.release("r1")
    replicas.sync_until(0.4)
    assert replicas.load("a") == InstanceLoad() and replicas.total_inflight() == 0


def test_bursts_are_spread_until_the_next_timestamp():
    def request(index: int, at: float) -> TraceRequest:
        return TraceRequest(index, at, 512, 1, (index,))

    spread = spread_bursts([request(0, 0.0), request(1, 0.0), request(2, 0.0), request(3, 3.0), request(4, 3.0)])
    assert [r.arrival_s for r in spread] == [0.0, 1.0, 2.0, 3.0, 3.0]  # the last burst has no next: kept
    assert [r.index for r in spread] == [0, 1, 2, 3, 4]
