"""Engines that hang, fail in a row, cannot be dialled or leak their errors: the gateway fails over,
ejects outliers, never answers 500 for an unreachable instance, keeps engine bodies in its log and
counts broken streams apart. Real HTTP over loopback; every test ends with the account at zero."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from prometheus_client import CollectorRegistry

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.fleet.outliers import OutlierDetector
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.metrics.definitions import gateway_metrics
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    counter_value,
    gateway_settings,
    tokenizer,
    wait_until,
)
from tests.hung_engine import HungEngine
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream


@pytest.fixture
async def opened():
    items: list = []
    yield items
    for item in reversed(items):
        await item.close()


async def start(opened: list, upstreams: dict[str, str], **overrides):
    gateway = await start_gateway(gateway_settings(upstreams, MODEL, **overrides), tokenizer=tokenizer())
    opened.append(gateway)
    return gateway


async def post(url: str, body: dict, timeout_s: float = 20) -> tuple[int, bytes]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session, session.post(url + "/v1/completions",
                                                                                  json=body) as response:
        return response.status, await response.read()


async def test_stream_from_a_hung_engine_is_retried_after_the_first_byte_timeout(opened):
    hung = await HungEngine().start()
    good = await ScriptedUpstream("good", Script()).start()
    opened += [hung, good]
    # Round robin puts the hung engine first for one of two requests; its read timeout (the gap
    # between chunks) is far beyond the test's patience.
    gateway = await start(opened, {"hung": hung.url, "good": good.url}, upstream_first_byte_timeout_s=0.5,
                          upstream_read_timeout_s=600, dispatch_policy="round_robin")
    for _ in range(2):
        status, body = await post(gateway.url, {"model": MODEL, "prompt": "p", "stream": True}, timeout_s=15)
        assert status == 200 and b"good-0" in body
    assert hung.generations == 1 and len(good.seen) == 2
    assert counter_value(gateway, "kvgate_forward_retries_total", instance="hung") == 1
    await wait_until(lambda: hung.open == 0)  # the gateway hung up on it
    await assert_nothing_in_flight(gateway)


async def test_waiting_whole_answers_fail_over_when_health_checks_eject_the_engine(opened):
    # A whole (non-streamed) answer only comes once generated, so it waits the read timeout, not
    # the first-byte one; ejecting the engine must release it at once, retried elsewhere.
    hung = await HungEngine().start()
    good = await ScriptedUpstream("good", Script()).start()
    opened += [hung, good]
    gateway = await start(opened, {"hung": hung.url, "good": good.url}, upstream_first_byte_timeout_s=600,
                          upstream_read_timeout_s=600, health_check_interval_s=0.2,
                          health_check_failures_to_eject=2, upstream_connect_timeout_s=0.2,
                          dispatch_policy="round_robin")
    for _ in range(2):
        status, body = await post(gateway.url, {"model": MODEL, "prompt": "p"}, timeout_s=15)
        assert status == 200 and b"good-0" in body
    assert hung.generations == 1
    assert not gateway.app[GATEWAY].registry.get("hung").healthy
    await assert_nothing_in_flight(gateway)


async def test_consecutive_request_failures_eject_the_instance_until_health_checks_readmit_it(opened):
    # /health passes but every generation fails: only passive outlier detection can see it.
    broken = await ScriptedUpstream("broken", Script(status=500)).start()
    good = await ScriptedUpstream("good", Script()).start()
    opened += [broken, good]
    gateway = await start(opened, {"broken": broken.url, "good": good.url},
                          dispatch_policy="round_robin", outlier_consecutive_failures=3,
                          outlier_ejection_s=0.5, health_check_interval_s=0.1)
    registry = gateway.app[GATEWAY].registry
    for _ in range(12):
        status, _ = await post(gateway.url, {"model": MODEL, "prompt": "p"})
        assert status == 200
    # Round robin sends every other request to "broken" first: the 3rd failure ejects it.
    assert len(broken.seen) == 3
    assert counter_value(gateway, "kvgate_outlier_ejections_total", instance="broken") == 1
    assert counter_value(gateway, "kvgate_instance_healthy", instance="broken") == 0
    # Health checks pass, but not before the ejection period is over.
    assert not registry.get("broken").healthy
    await wait_until(lambda: registry.get("broken").healthy, timeout_s=5)
    broken.script.status = 200
    for _ in range(4):
        assert (await post(gateway.url, {"model": MODEL, "prompt": "p"}))[0] == 200
    assert len(broken.seen) > 3
    await assert_nothing_in_flight(gateway)


def test_a_success_resets_the_failure_count_and_half_the_fleet_at_most_is_ejected():
    instances = [InstanceConfig(id=name, url=f"http://127.0.0.1:{port}", model=MODEL)
                 for name, port in (("a", 1), ("b", 2), ("c", 3), ("d", 4))]
    registry = InstanceRegistry(instances)
    detector = OutlierDetector(registry, gateway_metrics(CollectorRegistry()), failures=2, ejection_s=60)
    for _ in range(3):
        detector.failure("a", "HTTP 500")
        detector.success("a")
    assert registry.get("a").healthy  # never two in a row
    for name in ("a", "b", "c"):
        detector.failure(name, "HTTP 500")
        detector.failure(name, "HTTP 500")
    # A client able to make engines fail must not empty the fleet: two of four at most.
    assert [registry.get(n).healthy for n in "abcd"] == [False, False, True, True]
    registry.record_health("a", ok=True, failures_to_eject=2)
    assert not registry.get("a").healthy  # its ejection period is not over


@pytest.mark.parametrize("bad_url", ["http://127.0.0.1:99999/", "http://:19599/", "http://127.0.0.1 x:8000/"])
async def test_an_instance_that_cannot_be_dialled_is_retried_never_a_500(opened, bad_url):
    good = await ScriptedUpstream("good", Script()).start()
    opened.append(good)
    gateway = await start(opened, {"good": good.url}, dispatch_policy="round_robin",
                          outlier_consecutive_failures=0)
    # Added at run time the way the admin route does, past any validation at the door.
    gateway.app[GATEWAY].registry.add(InstanceConfig.model_construct(id="bad", url=bad_url, model=MODEL))
    for _ in range(4):
        status, body = await post(gateway.url, {"model": MODEL, "prompt": "p"})
        assert status == 200 and b"good-0" in body, body
    assert counter_value(gateway, "kvgate_forward_retries_total", instance="bad") == 2
    await assert_nothing_in_flight(gateway)


async def test_502_hides_the_engine_body_from_the_client_and_logs_it(opened, caplog):
    leaky = await ScriptedUpstream("leaky", Script(status=500)).start()
    opened.append(leaky)
    gateway = await start(opened, {"leaky": leaky.url})
    with caplog.at_level(logging.WARNING, logger="kvgate.gateway.http.relay"):
        async with aiohttp.ClientSession() as session, session.post(
                gateway.url + "/v1/completions", json={"model": MODEL, "prompt": "p"},
                headers={"X-Request-Id": "req-42"}) as response:
            status, body = response.status, await response.json()
    assert status == 502
    assert "leaky says 500" not in body["error"]["message"]
    assert "req-42" in body["error"]["message"] and body["error"]["code"] == "upstream_unavailable"
    assert any("req-42" in r.getMessage() and "leaky says 500" in r.getMessage() for r in caplog.records)
    await assert_nothing_in_flight(gateway)


async def test_a_stream_broken_mid_way_is_counted_as_stream_error_not_200(opened):
    dying = await ScriptedUpstream("dying", Script(chunks=6, die_after_chunks=2)).start()
    sound = await ScriptedUpstream("sound", Script()).start()
    opened += [dying, sound]
    gateway = await start(opened, {"dying": dying.url, "sound": sound.url}, outlier_consecutive_failures=2,
                          dispatch_policy="round_robin")
    bodies = []
    for _ in range(4):
        status, body = await post(gateway.url, {"model": MODEL, "prompt": "p", "stream": True})
        assert status == 200
        bodies.append(body)
    assert sum(b"upstream_stream_error" in body for body in bodies) == 2
    route = "/v1/completions"
    assert counter_value(gateway, "kvgate_requests_total", route=route, status="stream_error") == 2
    assert counter_value(gateway, "kvgate_requests_total", route=route, status="200") == 2
    # Broken streams are engine failures for outlier detection too.
    assert counter_value(gateway, "kvgate_outlier_ejections_total", instance="dying") == 1
    await assert_nothing_in_flight(gateway)


async def test_concurrent_streams_waiting_on_a_hung_engine_all_fail_over(opened):
    hung = await HungEngine().start()
    good = await ScriptedUpstream("good", Script()).start()
    opened += [hung, good]
    gateway = await start(opened, {"hung": hung.url, "good": good.url}, upstream_first_byte_timeout_s=60,
                          dispatch_policy="round_robin", outlier_consecutive_failures=1,
                          health_check_interval_s=0.2, upstream_connect_timeout_s=0.2)
    results = await asyncio.gather(*(post(gateway.url, {"model": MODEL, "prompt": "p", "stream": True}, 15)
                                     for _ in range(6)))
    assert all(status == 200 and b"good-" in body for status, body in results)
    assert hung.generations >= 1
    await assert_nothing_in_flight(gateway)
