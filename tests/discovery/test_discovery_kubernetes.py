"""--discovery kubernetes against a protocol fake of the API server (tests/k8s_fake.py): a real
gateway in front of scripted engines, each on its own loopback address and the same port, as pods."""

from __future__ import annotations

import asyncio
import logging
import socket

import aiohttp
import pytest

from kvgate.gateway.http.server import GatewayHandle, start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    counter_value,
    gateway_settings,
    read_streamed_completion,
    tokenizer,
    wait_until,
)
from tests.k8s_fake import NAMESPACE, FakeKubeAPI
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

ENGINE = {"app": "engine"}
IPS = {"a": "127.0.0.2", "b": "127.0.0.3", "c": "127.0.0.4"}


def _shared_port() -> int:
    """A port free on every engine address (each pod listens on the same port, as in a Deployment)."""
    for _ in range(20):
        with socket.socket() as probe:
            probe.bind((IPS["a"], 0))
            port = probe.getsockname()[1]
        try:
            for ip in IPS.values():
                with socket.socket() as other:
                    other.bind((ip, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every engine address")


@pytest.fixture
async def engines():
    port = _shared_port()
    started = {name: await ScriptedUpstream(name, Script(), host=ip, port=port).start() for name, ip in IPS.items()}
    yield started
    for engine in started.values():
        await engine.close()


@pytest.fixture
async def api():
    fake = await FakeKubeAPI().start()
    yield fake
    await fake.close()


async def start(api: FakeKubeAPI, engines: dict, tmp_path, static: dict | None = None, **overrides) -> GatewayHandle:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(api.kubeconfig())
    values = {"discovery": "kubernetes", "discovery_kubeconfig": str(kubeconfig), "discovery_namespace": NAMESPACE,
              "discovery_label_selector": "app=engine", "discovery_port": engines["a"]._runner.addresses[0][1],
              "discovery_model": MODEL, "discovery_backoff_max_s": 0.2, "dispatch_policy": "round_robin"}
    values.update(overrides)
    return await start_gateway(gateway_settings(static or {}, MODEL, **values), tokenizer=tokenizer())


def fleet(handle: GatewayHandle) -> dict[str, str]:
    return {state.id: state.config.url for state in handle.app[GATEWAY].registry.states()}


async def post(url: str, model: str = MODEL) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(
            url + "/v1/completions", json={"model": model, "prompt": "p"}) as response:
        return response.status, await response.json()


async def answered_by(url: str, count: int = 6, model: str = MODEL) -> set[str]:
    names = set()
    for _ in range(count):
        status, payload = await post(url, model)
        assert status == 200, payload
        names.add(payload["choices"][0]["text"].split("-")[0])
    return names


def metric(handle: GatewayHandle, name: str, **labels: str) -> float:
    return counter_value(handle, name, **labels)


async def test_ready_pods_join_unready_and_deleted_pods_leave(api, engines, tmp_path):
    api.put_pod("a", IPS["a"], ENGINE)
    api.put_pod("b", IPS["b"], ENGINE, ready=False)
    api.put_pod("c", IPS["c"], {"app": "other"})  # not selected
    handle = await start(api, engines, tmp_path)
    try:
        port = engines["a"]._runner.addresses[0][1]
        await wait_until(lambda: fleet(handle) == {"a": f"http://{IPS['a']}:{port}"})
        assert await answered_by(handle.url) == {"a"}

        api.change_pod("b", ready=True)
        await wait_until(lambda: set(fleet(handle)) == {"a", "b"})
        assert await answered_by(handle.url) == {"a", "b"}

        api.change_pod("a", ready=False)
        await wait_until(lambda: set(fleet(handle)) == {"b"})
        assert await answered_by(handle.url) == {"b"}

        api.change_pod("b", terminating=True)  # being deleted: leaves before the pod is gone
        await wait_until(lambda: fleet(handle) == {})
        api.delete_pod("b")
        assert (await post(handle.url))[0] == 404  # no instance serves the model any more

        api.change_pod("a", ready=True)
        await wait_until(lambda: set(fleet(handle)) == {"a"})
        assert await answered_by(handle.url) == {"a"}
        # The list+watch protocol as an API server expects it.
        watches = [query for path, query in api.requests if query.get("watch")]
        assert watches and all(q["allowWatchBookmarks"] in ("true", "True") and q["labelSelector"] == "app=engine"
                               and q["resourceVersion"] for q in watches)
        assert metric(handle, "kvgate_discovery_relists_total", reason="start") == 1
        assert metric(handle, "kvgate_discovery_events_total", source="kubernetes", event="MODIFIED") >= 4
        assert metric(handle, "kvgate_discovery_changes_total", change="removed") == 2
        assert metric(handle, "kvgate_discovery_instances") == 1
        assert metric(handle, "kvgate_discovery_source_up", source="kubernetes") == 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_a_pod_leaving_mid_stream_lets_the_stream_finish(api, engines, tmp_path):
    engines["a"].script = Script(chunks=20, delay_s=0.02)
    api.put_pod("a", IPS["a"], ENGINE)
    api.put_pod("b", IPS["b"], ENGINE)
    handle = await start(api, engines, tmp_path)
    try:
        await wait_until(lambda: set(fleet(handle)) == {"a", "b"})
        # Round robin: one on each.
        streams = [asyncio.create_task(read_streamed_completion(handle.url, MODEL)) for _ in range(2)]
        await wait_until(lambda: engines["a"].open_streams == 1)
        api.change_pod("a", ready=False)
        await wait_until(lambda: set(fleet(handle)) == {"b"})
        bodies = await asyncio.gather(*streams)
        assert any(b"a-19" in body for body in bodies)
        assert all(body.endswith(b"data: [DONE]\n\n") for body in bodies)
        await assert_nothing_in_flight(handle)
        assert handle.app[GATEWAY].account.inflight("a") == (0, 0)
    finally:
        await handle.close()


async def test_a_relabelled_pod_is_replaced(api, engines, tmp_path):
    api.put_pod("a", IPS["a"], ENGINE)
    api.put_pod("b", IPS["b"], ENGINE)
    handle = await start(api, engines, tmp_path, pd_protocol="vllm")
    try:
        await wait_until(lambda: set(fleet(handle)) == {"a", "b"})
        registry = handle.app[GATEWAY].registry
        # A model name is no valid label value: it comes as an annotation.
        api.change_pod("b", annotations={"kvgate.io/model": "org/other-model"})
        await wait_until(lambda: registry.get("b") is not None and registry.get("b").config.model == "org/other-model")
        assert await answered_by(handle.url) == {"a"}
        assert await answered_by(handle.url, 2, model="org/other-model") == {"b"}

        api.change_pod("a", labels={**ENGINE, "kvgate.io/role": "decode"},
                       annotations={"kvgate.io/kv-events-port": "5557"})
        await wait_until(lambda: registry.get("a") is not None and registry.get("a").config.role == "decode")
        assert registry.get("a").config.kv_events_endpoint == f"tcp://{IPS['a']}:5557"
        assert metric(handle, "kvgate_discovery_changes_total", change="replaced") == 2
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_an_expired_watch_relists(api, engines, tmp_path):
    api.put_pod("a", IPS["a"], ENGINE)
    api.put_pod("b", IPS["b"], ENGINE)
    handle = await start(api, engines, tmp_path)
    try:
        await wait_until(lambda: set(fleet(handle)) == {"a", "b"} and api.watches_open() == 1)
        api.bookmark()  # moves the watch's resourceVersion on; nothing changes
        # Changes the watch never sees, then history compacted: only a relist can learn of them.
        api.delete_pod("b", deliver=False)
        api.put_pod("c", IPS["c"], ENGINE, deliver=False)
        api.compact()
        await wait_until(lambda: set(fleet(handle)) == {"a", "c"})
        assert metric(handle, "kvgate_discovery_relists_total", reason="expired") == 1
        assert metric(handle, "kvgate_discovery_events_total", source="kubernetes", event="BOOKMARK") >= 1
        assert metric(handle, "kvgate_discovery_errors_total", source="kubernetes", reason="api") == 0
        assert await answered_by(handle.url) == {"a", "c"}
    finally:
        await handle.close()


async def test_routing_continues_while_the_api_server_is_down(api, engines, tmp_path, caplog):
    api.put_pod("a", IPS["a"], ENGINE)
    api.put_pod("b", IPS["b"], ENGINE)
    handle = await start(api, engines, tmp_path)
    try:
        await wait_until(lambda: set(fleet(handle)) == {"a", "b"} and api.watches_open() == 1)
        with caplog.at_level(logging.WARNING, logger="kvgate.discovery.kubernetes"):
            await api.go_down()
            await wait_until(lambda: metric(handle, "kvgate_discovery_errors_total", source="kubernetes",
                                            reason="api") >= 2)
        assert "keeping the last known fleet" in caplog.text
        assert metric(handle, "kvgate_discovery_source_up", source="kubernetes") == 0
        assert set(fleet(handle)) == {"a", "b"}
        assert await answered_by(handle.url) == {"a", "b"}

        api.delete_pod("b")  # while nobody watches
        await api.come_back()
        await wait_until(lambda: set(fleet(handle)) == {"a"})
        assert metric(handle, "kvgate_discovery_relists_total", reason="error") >= 1
        assert metric(handle, "kvgate_discovery_source_up", source="kubernetes") == 1
        assert await answered_by(handle.url) == {"a"}
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_inference_pool_names_the_pods_and_ports(api, engines, tmp_path):
    port = engines["a"]._runner.addresses[0][1]
    api.put_pool("llama", {"pool": "llama"}, [port])
    api.put_pod("a", IPS["a"], {"pool": "llama"})
    api.put_pod("b", IPS["b"], {"pool": "llama"})
    api.put_pod("c", IPS["c"], {"pool": "mistral"})
    handle = await start(api, engines, tmp_path, discovery_label_selector="", discovery_inference_pool="llama",
                         discovery_port=1, discovery_watch_timeout_s=1)
    try:
        await wait_until(lambda: fleet(handle) == {"a": f"http://{IPS['a']}:{port}", "b": f"http://{IPS['b']}:{port}"})
        assert await answered_by(handle.url) == {"a", "b"}
        # The pool's selector changes: seen when the current watch ends, then the pods are listed again.
        api.put_pool("llama", {"pool": "mistral"}, [port])
        await wait_until(lambda: set(fleet(handle)) == {"c"}, timeout_s=10)
        assert metric(handle, "kvgate_discovery_relists_total", reason="pool_changed") == 1
        assert await answered_by(handle.url) == {"c"}
        # Every target port is an endpoint of its own.
        api.put_pool("llama", {"pool": "mistral"}, [port, port + 1])
        await wait_until(lambda: set(fleet(handle)) == {"c:" + str(port), f"c:{port + 1}"}, timeout_s=10)
        assert any(path.endswith("/inferencepools/llama") for path, _ in api.requests)
    finally:
        await handle.close()


async def test_bad_pods_and_taken_ids_are_left_out(api, engines, tmp_path):
    static_b = engines["b"].url
    api.put_pod("a", IPS["a"], ENGINE, annotations={"kvgate.io/bootstrap-port": "not-a-port"})
    api.put_pod("b", IPS["c"], ENGINE)  # its id is a static instance's
    api.put_pod("c", IPS["c"], {**ENGINE, "kvgate.io/role": "prefill"})  # no --pd-protocol: refused
    handle = await start(api, engines, tmp_path, static={"b": static_b})
    try:
        await wait_until(lambda: metric(handle, "kvgate_discovery_errors_total", source="kubernetes",
                                        reason="instance_refused") == 1)
        assert metric(handle, "kvgate_discovery_errors_total", source="kubernetes", reason="pod_invalid") == 1
        assert metric(handle, "kvgate_discovery_errors_total", source="kubernetes", reason="instance_conflict") == 1
        assert fleet(handle) == {"b": static_b}  # the static instance untouched
        # Fixed labels: the pods join.
        api.change_pod("a", annotations={})
        api.change_pod("c", labels=ENGINE)
        await wait_until(lambda: set(fleet(handle)) == {"a", "b", "c"})
        assert await answered_by(handle.url) == {"a", "b", "c"}
        api.delete_pod("b")  # discovery never added it: the static instance stays
        api.delete_pod("a")
        await wait_until(lambda: set(fleet(handle)) == {"b", "c"})
    finally:
        await handle.close()


async def test_missing_credentials_keep_the_static_fleet(engines, tmp_path, caplog):
    static_a = engines["a"].url
    with caplog.at_level(logging.WARNING, logger="kvgate.discovery.kubernetes"):
        handle = await start_gateway(gateway_settings(
            {"a": static_a}, MODEL, discovery="kubernetes", discovery_kubeconfig=str(tmp_path / "absent"),
            discovery_label_selector="app=engine", discovery_backoff_max_s=0.05), tokenizer=tokenizer())
        try:
            await wait_until(lambda: metric(handle, "kvgate_discovery_errors_total", source="kubernetes",
                                            reason="config") >= 2)
            assert "no usable Kubernetes credentials" in caplog.text
            assert fleet(handle) == {"a": static_a}
            assert await answered_by(handle.url, 2) == {"a"}
        finally:
            await handle.close()
