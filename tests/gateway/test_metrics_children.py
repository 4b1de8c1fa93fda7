"""Labelled metric children kept by the request path: created on first use, then reused."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, generate_latest

from kvgate.metrics.children import Children


def test_a_child_is_created_on_first_use_and_reused():
    registry = CollectorRegistry()
    counter = Counter("things", "Things by kind.", ["kind", "outcome"], registry=registry)
    children = Children(counter)
    assert b"things_total{" not in generate_latest(registry)  # no series before a label is used
    children("a", "ok").inc()
    children("a", "ok").inc(2)
    children("b", "failed").inc()
    assert children("a", "ok") is children("a", "ok") is counter.labels("a", "ok")
    assert registry.get_sample_value("things_total", {"kind": "a", "outcome": "ok"}) == 3
    assert registry.get_sample_value("things_total", {"kind": "b", "outcome": "failed"}) == 1
    assert registry.get_sample_value("things_total", {"kind": "a", "outcome": "failed"}) is None
