"""Panic routing: when health checks eject every instance of a model, requests still go to them."""

from __future__ import annotations

import pytest

from kvgate.config.settings import InstanceConfig, InstanceRole
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    closed_port_url,
    counter_value,
    gateway_settings,
    tokenizer,
    wait_until,
)
from tests.openai_helpers import openai_client
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

pytestmark = [pytest.mark.usefixtures("close_openai_clients"), pytest.mark.timeout(60)]


async def test_a_fleet_whose_health_checks_all_fail_still_serves(caplog):
    # e0 is really dead; e1 answers requests but its /health fails (busy, as in a first NIXL handshake).
    busy = await ScriptedUpstream("e1", Script(health_status=503)).start()
    settings = gateway_settings({"e0": closed_port_url(), "e1": busy.url}, MODEL, health_check_interval_s=0.05,
                                health_check_failures_to_eject=2, upstream_connect_timeout_s=0.5)
    handle = await start_gateway(settings, tokenizer=tokenizer())
    registry = handle.app[GATEWAY].registry
    try:
        await wait_until(lambda: not any(s.healthy for s in registry.states()))
        await wait_until(lambda: counter_value(handle, "kvgate_routing_panic", model=MODEL) == 1)
        client = openai_client(handle.url)
        for i in range(6):  # whichever is ranked first, a failure on dead e0 is retried on e1
            answer = await client.completions.create(model=MODEL, prompt=f"hello {i}", max_tokens=3)
            assert answer.choices[0].text
        assert len(busy.seen) == 6
        assert "routing to them anyway (panic)" in caplog.text
        # e1's health checks pass again: panic is over, and dead e0 is out of routing.
        busy.script = Script()
        await wait_until(lambda: counter_value(handle, "kvgate_routing_panic", model=MODEL) == 0)
        assert [s.id for s in registry.routable(MODEL)] == ["e1"]
        await client.completions.create(model=MODEL, prompt="again", max_tokens=3)
        await client.close()
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()
        await busy.close()


def instance(instance_id: str, role: InstanceRole, model: str = "m") -> InstanceConfig:
    return InstanceConfig(id=instance_id, url="http://127.0.0.1:9", model=model, role=role)


def test_panic_is_per_model_and_role_and_leaves_drained_instances_out():
    registry = InstanceRegistry([instance("p0", InstanceRole.PREFILL), instance("p1", InstanceRole.PREFILL),
                                 instance("d0", InstanceRole.DECODE), instance("x0", InstanceRole.NEUTRAL, "other")])
    aborted = []
    registry.on_eject = aborted.append
    registry.record_health("p0", ok=False, failures_to_eject=1)
    assert [s.id for s in registry.routable("m")] == ["p1", "d0"] and aborted == [registry.get("p0")]
    # The last prefill instance goes: both are routed to again; its waiting requests are not failed over.
    registry.record_health("p1", ok=False, failures_to_eject=1)
    assert [s.id for s in registry.routable("m")] == ["p0", "p1", "d0"] and len(aborted) == 1
    assert registry.panicking("m") and not registry.panicking("other")
    registry.drain("p1")
    assert [s.id for s in registry.routable("m")] == ["p0", "d0"]
    registry.record_health("p0", ok=True, failures_to_eject=1)
    assert not registry.panicking("m") and [s.id for s in registry.routable("m")] == ["p0", "d0"]
