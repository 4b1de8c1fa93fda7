"""`kvgate serve --workers 2 --discovery file`: the leader worker alone follows the file, every worker routes
by the shared instance table, and a leader that is killed and restarted takes up where it left off."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.processes import free_port
from kvgate.workers.worker import WORKER_HEADER
from tests.discovery.test_discovery_file import instances, write
from tests.gateway_helpers import read_streamed_completion, scripted_upstreams, wait_until
from tests.scripted_upstream import MODEL, Script
from tests.workers.test_workers_serve import start_workers, views, wait_listening, whole_gateway_inflight

pytestmark = pytest.mark.timeout(240)

ADMIN = {"Authorization": "Bearer t"}
# The settings' own instance, of another model: discovery must leave it alone, and requests for MODEL
# reach only the discovered engines.
STATIC = "e0"
STATIC_MODEL = "static-model"
WAIT_S = 60.0  # a restarted worker loads its tokenizer first: seconds on a busy machine

# Worker index -> engine names that answered the completions it routed.
Answers = dict[str, list[str]]


@pytest.fixture
async def engines():
    async with scripted_upstreams(STATIC, "a", "b", "c") as started:
        yield started


@contextlib.asynccontextmanager
async def discovering_gateway(tmp_path: Path, engines: dict, *names: str) -> AsyncIterator[tuple[str, Path]]:
    """Two workers following fleet.yaml, which first lists `names`; yields (gateway URL, file path).
    Stopped with SIGTERM at the end, which must end it cleanly."""
    path = tmp_path / "fleet.yaml"
    write(path, yaml.safe_dump(instances(engines, *names)))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_workers(
        tmp_path, engines[STATIC].url, port, workers_max_instances=8, dispatch_policy="round_robin",
        instances=[{"id": STATIC, "url": engines[STATIC].url, "model": STATIC_MODEL}],
        discovery="file", discovery_file=str(path), discovery_file_poll_interval_s=0.05,
        # Probes stay out of the way: an engine ejected by a slow check on a busy machine is not the subject.
        health_check_interval_s=60, stats_poll_interval_s=60)
    # Read all along: a full stderr pipe would stop the workers' logging, and with it the workers.
    stderr = asyncio.ensure_future(asyncio.to_thread(process.stderr.read))
    try:
        await wait_listening(process, url)
        yield url, path
        process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 60)
        assert code == 0, await stderr
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await stderr


async def by_worker(url: str, path: str, until: Callable[[dict[str, int]], bool] | None = None,
                    ) -> dict[str, tuple[int, dict]]:
    """GET `path` (with the admin token) as each worker answers it: worker index -> (pid, JSON body).
    Fresh connections, which the kernel spreads over the workers, until both answered and `until`
    (given worker index -> pid) holds; refused connections (a worker just killed) are tried again."""
    seen: dict[str, tuple[int, dict]] = {}
    deadline = time.monotonic() + WAIT_S
    while len(seen) < 2 or (until is not None and not until({i: pid for i, (pid, _) in seen.items()})):
        assert time.monotonic() < deadline, f"workers answering {path}: {sorted(seen)}"
        try:
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                    session.get(url + path, headers=ADMIN) as response:
                assert response.status == 200, await response.text()
                index, pid = response.headers[WORKER_HEADER].split(":")
                seen[index] = int(pid), await response.json()
        except aiohttp.ClientConnectionError:
            await asyncio.sleep(0.05)
    return seen


async def fleets(url: str) -> dict[str, list[str]]:
    """The instance ids each worker holds (a list: an instance held twice would show twice)."""
    answers = await by_worker(url, "/admin/instances")
    return {index: sorted(i["id"] for i in body["instances"]) for index, (_, body) in answers.items()}


async def wait_fleets(url: str, *discovered: str) -> None:
    """Until every worker holds exactly the static instance and `discovered`."""
    wanted = sorted([STATIC, *discovered])
    deadline = time.monotonic() + WAIT_S
    while set(map(tuple, (held := await fleets(url)).values())) != {tuple(wanted)}:
        assert time.monotonic() < deadline, f"workers hold {held}, not {wanted}"
        await asyncio.sleep(0.1)


async def complete_until(url: str, done: Callable[[Answers], bool], limit: int = 200) -> Answers:
    """Whole completions over fresh connections until `done` holds for the engines that answered them,
    by the worker that routed them."""
    answered: Answers = {"0": [], "1": []}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session:
        for _ in range(limit):
            if done(answered):
                return answered
            async with session.post(url + "/v1/completions",
                                    json={"model": MODEL, "prompt": "p", "max_tokens": 3}) as response:
                payload = await response.json()
                assert response.status == 200, payload
                engine = payload["choices"][0]["text"].split("-")[0]
                answered[response.headers[WORKER_HEADER].split(":")[0]].append(engine)
    raise AssertionError(f"after {limit} completions: {answered}")


def every_worker_reached(*engines: str, times: int = 1) -> Callable[[Answers], bool]:
    return lambda answered: all(a.count(e) >= times for a in answered.values() for e in engines)


async def metric_sum(url: str, sample: str, **labels: str) -> float:
    """A sample of the whole gateway's /metrics, summed over the workers (and their other labels)."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == sample and labels.items() <= s.labels.items())


async def nothing_in_flight(url: str) -> None:
    """Every worker's view of the shared account, and the whole gateway's gauges, back to zero."""
    deadline = time.monotonic() + WAIT_S
    while True:
        answers = await by_worker(url, "/admin/instances")
        inflight = {index: {i["id"]: i["inflight_requests"] for i in body["instances"] if i["inflight_requests"]}
                    for index, (_, body) in answers.items()}
        if not any(inflight.values()) and await whole_gateway_inflight(url) == 0:
            return
        assert time.monotonic() < deadline, f"still in flight: {inflight}"
        await asyncio.sleep(0.1)


async def test_an_engine_added_to_the_file_is_routed_to_by_every_worker(tmp_path, engines):
    async with discovering_gateway(tmp_path, engines, "a") as (url, path):
        await wait_fleets(url, "a")
        await complete_until(url, every_worker_reached("a"))
        write(path, yaml.safe_dump(instances(engines, "a", "b")))
        await wait_fleets(url, "a", "b")
        # Only worker 0 read the file; worker 1 plans with b too, and both send it requests.
        assert {index: sorted(i["id"] for i in view["instances"]) for index, view in (await views(url)).items()} \
            == {"0": ["a", "b"], "1": ["a", "b"]}
        answered = await complete_until(url, every_worker_reached("a", "b"))
        assert len(engines["b"].seen) == sum(a.count("b") for a in answered.values())
        assert all(seen.body["model"] == MODEL for seen in engines["b"].seen)
        assert engines[STATIC].seen == []  # another model's instance, left as the settings put it
        await nothing_in_flight(url)


async def test_an_engine_removed_from_the_file_takes_no_new_request_and_finishes_its_stream(tmp_path, engines):
    engines["b"].script = Script(chunks=200, delay_s=0.05)  # a stream of about ten seconds
    async with discovering_gateway(tmp_path, engines, "b") as (url, path):
        await wait_fleets(url, "b")
        streaming = asyncio.create_task(read_streamed_completion(url, MODEL))
        await wait_until(lambda: engines["b"].open_streams == 1, WAIT_S)
        write(path, yaml.safe_dump(instances(engines, "a")))
        await wait_fleets(url, "a")
        answered = await complete_until(url, every_worker_reached("a", times=3))
        assert {engine for a in answered.values() for engine in a} == {"a"}
        assert len(engines["b"].seen) == 1 and engines["b"].open_streams == 1  # still streaming, alone
        body = await asyncio.wait_for(streaming, WAIT_S)
        assert b"b-199" in body and body.endswith(b"data: [DONE]\n\n")
        assert engines["b"].cancelled == 0
        await nothing_in_flight(url)
        # b back under the same id: whichever worker relayed its stream counts nothing left from it.
        engines["b"].script = Script()
        write(path, yaml.safe_dump(instances(engines, "a", "b")))
        await wait_fleets(url, "a", "b")
        await complete_until(url, every_worker_reached("b", times=2))
        await nothing_in_flight(url)


async def test_a_restarted_leader_takes_up_the_instances_it_had_discovered(tmp_path, engines):
    async with discovering_gateway(tmp_path, engines, "a", "b") as (url, path):
        await wait_fleets(url, "a", "b")
        leader = (await by_worker(url, "/admin/instances"))["0"][0]
        reloads = await metric_sum(url, "kvgate_discovery_events_total", source="file", event="reload")
        os.kill(leader, signal.SIGKILL)
        await by_worker(url, "/admin/instances", until=lambda pids: pids.get("0", leader) != leader)
        # The new leader read the file once more, and found its instances already in the shared table.
        deadline = time.monotonic() + WAIT_S
        while await metric_sum(url, "kvgate_discovery_events_total", source="file", event="reload") <= reloads:
            assert time.monotonic() < deadline, "the restarted leader does not read the file"
            await asyncio.sleep(0.1)
        await wait_fleets(url, "a", "b")
        assert await metric_sum(url, "kvgate_discovery_errors_total") == 0
        # A change made after the restart: a leaves, c comes; every worker follows it.
        write(path, yaml.safe_dump(instances(engines, "b", "c")))
        await wait_fleets(url, "b", "c")
        answered_by_a = len(engines["a"].seen)
        answered = await complete_until(url, every_worker_reached("b", "c"))
        assert "a" not in {engine for a in answered.values() for engine in a}
        assert len(engines["a"].seen) == answered_by_a
        assert await metric_sum(url, "kvgate_discovery_changes_total", change="removed") == 1
        assert await metric_sum(url, "kvgate_discovery_errors_total") == 0
        await nothing_in_flight(url)
