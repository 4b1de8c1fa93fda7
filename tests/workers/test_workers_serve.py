"""`kvgate serve --workers 2` as operators run it: one port, one account, one prober, crash and stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.processes import free_port
from kvgate.workers.worker import WORKER_HEADER
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

pytestmark = pytest.mark.timeout(120)

ENGINE_METRICS = "vllm:num_requests_running 7\nvllm:num_requests_waiting 0\n"
# A stream that lasts until the test ends it, from an engine that reports nothing running.
HOLD = Script(chunks=400, delay_s=0.1, metrics_text=ENGINE_METRICS.replace("7", "0"))


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    engine = await ScriptedUpstream("e0", Script(metrics_text=ENGINE_METRICS)).start()
    yield engine
    await engine.close()


def start_workers(tmp_path, upstream_url: str, port: int, **overrides) -> subprocess.Popen:
    """Two workers in front of e0 at `upstream_url`; `overrides` replace or add settings (file keys)."""
    config = tmp_path / "gateway.yaml"
    config.write_text(orjson.dumps({
        "port": port, "workers": 2, "admin_token": "t", "kvs_backend": "embedded", "workers_max_instances": 2,
        "stats_poll_interval_s": 0.2, "health_check_interval_s": 0.2,
        "instances": [{"id": "e0", "url": upstream_url, "model": MODEL}],
        **overrides,
    }).decode())  # JSON is YAML
    return subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


def stop_workers(process: subprocess.Popen) -> None:
    """SIGTERM, and SIGKILL if the gateway has not stopped within a minute."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


async def wait_listening(process: subprocess.Popen, url: str) -> None:
    """The supervisor says so once every worker listens."""
    line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), timeout=90)
    assert line.strip() == f"kvgate gateway listening on {url}", process.stderr.read()


async def views(url: str, wanted_workers: int = 2) -> dict[str, dict]:
    """/debug/schedule as each worker answers it, by worker index; fresh connections until all answered
    (a restarting worker takes seconds to load its tokenizer)."""
    seen: dict[str, dict] = {}
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 1}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        # A new connection each time: the kernel spreads connections over the workers.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.post(url + "/debug/schedule", json=body) as response:
            assert response.status == 200
            seen[response.headers[WORKER_HEADER]] = await response.json()
        if len({tag.split(":")[0] for tag in seen}) >= wanted_workers:
            return {tag.split(":")[0]: view for tag, view in seen.items()}
    raise AssertionError(f"only workers {sorted(seen)} answered")


async def every_worker_sees(url: str, requests: int) -> None:
    deadline = time.monotonic() + 30
    while any(num_requests(view) != requests for view in (await views(url)).values()):
        assert time.monotonic() < deadline, f"not every worker sees {requests} requests on the engine"
        await asyncio.sleep(0.2)


def num_requests(view: dict) -> float:
    return view["instances"][0]["metrics"]["num_requests"]


async def test_workers_share_one_account_one_prober_and_survive_a_crash(tmp_path, upstream):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_workers(tmp_path, upstream.url, port)
    try:
        await wait_listening(process, url)
        # Engine stats are scraped by the leader alone, yet every worker decides with them.
        await every_worker_sees(url, 7)
        upstream.script = HOLD  # from now on the engine reports nothing running
        await every_worker_sees(url, 0)
        async with aiohttp.ClientSession() as client:
            held = await client.post(url + "/v1/completions",
                                     json={"model": MODEL, "prompt": "x" * 3000, "stream": True, "max_tokens": 400})
            assert held.status == 200
            holder_index, holder_pid = held.headers[WORKER_HEADER].split(":")
            await held.content.readline()
            # The dispatch made by one worker is in the other's next decision: the account is shared.
            assert [num_requests(view) for view in (await views(url)).values()] == [1, 1]
            assert (await admin_instances(url))["inflight_requests"] == 1
            assert await whole_gateway_inflight(url) == 1
            # Killing the worker that holds it takes its rows out of the account; it is restarted.
            os.kill(int(holder_pid), signal.SIGKILL)
            deadline = time.monotonic() + 60
            while (await admin_instances(url))["inflight_requests"] != 0:
                assert time.monotonic() < deadline, "the dead worker's rows stayed in the account"
                await asyncio.sleep(0.2)
            held.close()
        restarted = await views(url)
        assert holder_index in restarted
        # An instance added through one worker is served by every worker.
        async with aiohttp.ClientSession() as client:
            added = await client.post(url + "/admin/instances", headers={"Authorization": "Bearer t"},
                                      json={"id": "e1", "url": upstream.url, "model": "other"})
            assert added.status == 201
            # The shared table has two slots: a third instance is refused by name, not as a duplicate.
            refused = await client.post(url + "/admin/instances", headers={"Authorization": "Bearer t"},
                                        json={"id": "e2", "url": upstream.url, "model": "other"})
            assert refused.status == 409
            assert (await refused.json())["error"]["code"] == "instance_table_full"
        models = await models_by_worker(url)
        assert all("other" in served for served in models.values())
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) == 0
        assert "died with exit code -9; clearing its rows and restarting it" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


async def test_gauges_computed_in_each_worker_reach_the_whole_gateways_metrics(tmp_path, upstream):
    """The tokenize cache and the TTFT calibration are each worker's own; /metrics, whichever worker
    answers, shows them merged (not the 0 a computed gauge reads from prometheus-client's files)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_workers(tmp_path, upstream.url, port)
    try:
        await wait_listening(process, url)
        answered_by: dict[str, int] = {}
        for n in range(40):  # fresh connections: the kernel spreads them over both workers
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                    session.post(url + "/v1/completions",
                                 json={"model": MODEL, "prompt": f"prompt {n} " * 50, "max_tokens": 2}) as response:
                assert response.status == 200
                worker = response.headers[WORKER_HEADER].split(":")[0]
                answered_by[worker] = answered_by.get(worker, 0) + 1
        assert len(answered_by) == 2, answered_by
        deadline = time.monotonic() + 10
        while True:
            metrics = await whole_gateway_metrics(url)
            observations = metrics.get(("kvgate_ttft_calibration_observations", (("instance", "e0"),)), 0)
            if observations == 40 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.3)
        assert observations == 40  # both workers' calibrations, summed
        assert metrics[("kvgate_tokenize_cache_bytes", ())] > 0
        assert metrics[("kvgate_ttft_calibration_factor", (("instance", "e0"), ("term", "compute")))] > 0
    finally:
        stop_workers(process)


async def whole_gateway_metrics(url: str) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted labels): value}."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


async def admin_instances(url: str) -> dict:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
            session.get(url + "/admin/instances", headers={"Authorization": "Bearer t"}) as response:
        return (await response.json())["instances"][0]


async def whole_gateway_inflight(url: str) -> float:
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    families = {family.name: family for family in text_string_to_metric_families(text)}
    return sum(sample.value for sample in families["kvgate_inflight_requests"].samples)


async def models_by_worker(url: str) -> dict[str, list[str]]:
    served: dict[str, list[str]] = {}
    for _ in range(500):
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.get(url + "/v1/models") as response:
            served[response.headers[WORKER_HEADER].split(":")[0]] = [m["id"] for m in (await response.json())["data"]]
        if len(served) == 2:
            return served
    raise AssertionError("only one worker answered")


def test_a_taken_port_is_a_clear_error(tmp_path):
    """Even a listener with SO_REUSEPORT (another gateway's workers) is not joined by accident."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run([sys.executable, "-m", "kvgate.cli", "serve", "--workers", "2", "--port", str(port)],
                                capture_output=True, text=True, timeout=60, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr
