"""Faults: a misbehaving /batch_query_keys server on loopback, a crashing backend, cancellation.

The lookup must come back with no hits within the budget (elapsed < budget + slack is a
correctness bound, not a benchmark), mark the store down after 1 + kvs_retry_times
consecutive failures, skip it while down, probe once afterwards, and never raise.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence

import orjson
import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgate.config.settings import Settings
from kvgate.kvs_client import SHARED_STORAGE, HashedPrompt, KVSAnswer, ResilientKVSClient
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.metrics.definitions import kvs_metrics

pytestmark = pytest.mark.timeout(60)

BUDGET_MS = 150
SLACK_S = 0.2
DOWN_S = 0.3
SETTINGS = Settings(
    kvs_query_budget_ms=BUDGET_MS,
    kvs_retry_times=2,
    kvs_retry_interval_ms=10,
    kvs_metadata_service_down_duration_s=DOWN_S,
)
ENDPOINT = "127.0.0.2:17901"


def _answer(keys: list[str], held: dict[str, dict]) -> dict:
    missing = {"ok": False, "error": "OBJECT_NOT_FOUND", "values": None, "disk_values": None,
               "local_disk_values": None, "nof_values": None}
    return {"success": True, "data": {key: held.get(key, missing) for key in keys}}


def _in_memory(endpoint: str) -> dict:
    return {"ok": True, "error": None, "values": [{"size_": 4096, "buffer_address_": 1, "protocol_": "tcp",
                                                   "transport_endpoint_": endpoint}],
            "disk_values": None, "local_disk_values": None, "nof_values": None}


class FakeMaster:
    """Answers /batch_query_keys the way `mode` says (only "k0" is held); counts the requests."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.delay_s = 0.0
        self.requests = 0
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.requests += 1
        keys = request.query.get("keys", "").split(",")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        held = {"k0": _in_memory(ENDPOINT)}
        bodies = {
            "ok": _answer(keys, held),
            "success_false": {"success": False, "error": "NOT_LEADER"},
            "data_is_a_list": {"success": True, "data": []},
            "key_left_out": _answer(keys[1:], {}),
            "values_not_a_list": _answer(keys, {"k0": {**_in_memory(ENDPOINT), "values": {"a": 1}}}),
            "endpoint_not_a_string": _answer(keys, {"k0": {**_in_memory(ENDPOINT), "values": [{"x": 1}]}}),
            "document_is_a_list": [1, 2],
        }
        if self.mode == "invalid_json":
            return web.Response(body=b'{"success": true, "data": {', content_type="application/json")
        if self.mode == "http_500":
            return web.Response(status=500, text="internal error")
        return web.Response(body=orjson.dumps(bodies[self.mode]), content_type="application/json")


@pytest.fixture
async def fake_master(aiohttp_free_server) -> FakeMaster:
    fake = FakeMaster()
    fake.url = await aiohttp_free_server(fake.handle)
    return fake


def _client(url: str, settings: Settings = SETTINGS, registry: CollectorRegistry | None = None,
            **backend_options) -> ResilientKVSClient:
    backend = MooncakeMasterBackend(url, request_timeout_s=settings.kvs_query_budget_ms / 1000, **backend_options)
    metrics = kvs_metrics(registry) if registry is not None else None
    return ResilientKVSClient(backend, settings, metrics)


def _assert_no_hits_within_budget(lookup, status: str, key_count: int) -> None:
    assert lookup.status == status
    assert lookup.locations == [()] * key_count
    assert lookup.disk_locations == [()] * key_count
    assert lookup.elapsed_s < BUDGET_MS / 1000 + SLACK_S


async def test_a_healthy_store_answers(fake_master):
    client = _client(fake_master.url)
    lookup = await client.lookup(["k0", "k1"])
    assert (lookup.status, lookup.locations) == ("ok", [(ENDPOINT,), ()])
    assert fake_master.requests == 1
    await client.close()


@pytest.mark.parametrize("mode", ["invalid_json", "http_500", "success_false", "data_is_a_list", "key_left_out",
                                  "values_not_a_list", "endpoint_not_a_string", "document_is_a_list"])
async def test_a_bad_answer_is_a_miss_and_marks_the_store_down_after_the_retries(fake_master, mode):
    fake_master.mode = mode
    client = _client(fake_master.url)
    lookup = await client.lookup(["k0", "k1", "k2"])
    _assert_no_hits_within_budget(lookup, "error", 3)
    # 1 attempt + kvs_retry_times retries, 10 ms apart, all inside the 150 ms budget.
    assert fake_master.requests == 1 + SETTINGS.kvs_retry_times
    assert client.is_down
    assert client.last_error
    await client.close()


async def test_a_slow_store_costs_at_most_the_budget_and_is_marked_down_after_repeated_timeouts(fake_master):
    fake_master.delay_s = 1.0
    client = _client(fake_master.url)
    for expected_requests in (1, 2, 3):
        # The first call times out at the budget, so no retry fits: one request per lookup.
        _assert_no_hits_within_budget(await client.lookup(["k0"]), "error", 1)
        assert fake_master.requests == expected_requests
    assert client.is_down, "1 + kvs_retry_times consecutive timeouts mark the store down"
    _assert_no_hits_within_budget(await client.lookup(["k0"]), "down", 1)
    assert fake_master.requests == 3
    await client.close()


async def test_a_store_that_refuses_connections_is_a_fast_miss():
    client = _client(f"http://127.0.0.1:{_closed_port()}")
    lookup = await client.lookup(["k0"])
    _assert_no_hits_within_budget(lookup, "error", 1)
    assert client.is_down
    await client.close()


def _closed_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def test_down_store_is_skipped_then_one_probe_brings_it_back(fake_master):
    registry = CollectorRegistry()
    client = _client(fake_master.url, registry=registry)
    fake_master.mode = "http_500"
    await client.lookup(["k0"])
    assert client.is_down and fake_master.requests == 3
    assert registry.get_sample_value("kvgate_kvs_service_up", {"backend": "mooncake"}) == 0

    # While down nothing is asked, and the answer is immediate.
    for _ in range(5):
        lookup = await client.lookup(["k0"])
        assert lookup.status == "down" and lookup.locations == [()]
        assert lookup.elapsed_s < 0.01
    assert fake_master.requests == 3

    # After the down period, a probe that fails keeps it down for another period: one request only.
    await asyncio.sleep(DOWN_S + 0.05)
    _assert_no_hits_within_budget(await client.lookup(["k0"]), "error", 1)
    assert fake_master.requests == 4 and client.is_down
    assert (await client.lookup(["k0"])).status == "down"
    assert fake_master.requests == 4

    # The next probe succeeds: lookups resume.
    fake_master.mode = "ok"
    await asyncio.sleep(DOWN_S + 0.05)
    lookup = await client.lookup(["k0", "k1"])
    assert (lookup.status, lookup.locations) == ("ok", [(ENDPOINT,), ()])
    assert not client.is_down
    assert registry.get_sample_value("kvgate_kvs_service_up", {"backend": "mooncake"}) == 1
    assert (await client.lookup(["k1"])).status == "ok"

    outcomes = {outcome: registry.get_sample_value("kvgate_kvs_queries_total", {"backend": "mooncake", "outcome": outcome})
                for outcome in ("hit", "miss", "error", "skipped_down")}
    assert outcomes == {"hit": 1, "miss": 1, "error": 2, "skipped_down": 6}
    assert registry.get_sample_value("kvgate_kvs_query_seconds_count", {"backend": "mooncake"}) == 4
    assert registry.get_sample_value("kvgate_kvs_keys_per_query_sum", {"backend": "mooncake"}) == 5
    await client.close()


async def _start_slow_probe(client: ResilientKVSClient, fake_master: FakeMaster, delay_s: float) -> asyncio.Task:
    """Marks the store down, waits out the down period and starts the probe, which the master (healthy
    again) answers after `delay_s`; returns once the probe's request is under way."""
    fake_master.mode = "http_500"
    await client.lookup(["k0"])
    await asyncio.sleep(DOWN_S + 0.05)
    fake_master.mode, fake_master.delay_s = "ok", delay_s
    probe = asyncio.create_task(client.lookup(["k0"]))
    await asyncio.sleep(delay_s / 5)
    return probe


async def test_lookups_arriving_during_the_probe_stay_skipped(fake_master):
    client = _client(fake_master.url)
    probe = await _start_slow_probe(client, fake_master, 0.05)
    during = await asyncio.gather(*(client.lookup(["k0"]) for _ in range(3)))
    assert [lookup.status for lookup in during] == ["down"] * 3
    assert (await probe).status == "ok"
    assert fake_master.requests == 3 + 1
    assert (await client.lookup(["k0"])).status == "ok"
    await client.close()


async def test_a_cancelled_probe_does_not_wedge_the_client(fake_master):
    client = _client(fake_master.url)
    probe = await _start_slow_probe(client, fake_master, 0.1)
    probe.cancel()
    with pytest.raises(asyncio.CancelledError):
        await probe
    fake_master.delay_s = 0
    assert (await client.lookup(["k0"])).status == "ok", "the next lookup probes again"
    await client.close()


async def test_success_resets_the_failure_count(fake_master):
    client = _client(fake_master.url, SETTINGS.model_copy(update={"kvs_retry_times": 2, "kvs_retry_interval_ms": 500}))
    # Retries do not fit in the budget, so each failing lookup is one failed attempt.
    fake_master.mode = "http_500"
    await client.lookup(["k0"])
    await client.lookup(["k0"])
    fake_master.mode = "ok"
    assert (await client.lookup(["k0"])).status == "ok"
    fake_master.mode = "http_500"
    await client.lookup(["k0"])
    await client.lookup(["k0"])
    assert not client.is_down, "two failures after a success are not three in a row"
    await client.lookup(["k0"])
    assert client.is_down
    await client.close()


class BrokenBackend:
    name = "broken"

    async def query(self, keys: Sequence[str], prompt: HashedPrompt | None = None) -> KVSAnswer:
        raise RuntimeError("a bug in a backend")

    async def close(self) -> None:
        pass


async def test_a_backend_bug_is_a_miss_not_an_exception():
    client = ResilientKVSClient(BrokenBackend(), SETTINGS)
    lookup = await client.lookup(["k0"])
    assert lookup.status == "error" and lookup.locations == [()]
    assert "a bug in a backend" in (client.last_error or "")


async def test_no_keys_asks_nothing(fake_master):
    client = _client(fake_master.url)
    lookup = await client.lookup([])
    assert (lookup.status, lookup.locations, fake_master.requests) == ("skipped", [], 0)
    await client.close()


def _fixed_answer(document: dict):
    async def handle(request: web.Request) -> web.Response:
        return web.json_response(document)
    return handle


async def test_disk_tiers_are_reported_when_asked_for(aiohttp_free_server):
    disk_entry = {"ok": True, "error": None, "values": None,
                  "disk_values": [{"file_path": "/dfs/obj", "object_size": 4096}],
                  "local_disk_values": [{"client_id": "c1", "object_size": 4096, "transport_endpoint": "127.0.0.3:1"}],
                  "nof_values": [{"size_": 4096, "transport_endpoint_": "127.0.0.4:1"}]}
    document = {"success": True, "data": {"mem": _in_memory(ENDPOINT), "disk": disk_entry}}
    url = await aiohttp_free_server(_fixed_answer(document))
    with_disk = _client(url, include_disk_tier=True)
    lookup = await with_disk.lookup(["mem", "disk"])
    assert lookup.locations == [(ENDPOINT,), ()]
    assert lookup.disk_locations == [(), ("127.0.0.3:1", "127.0.0.4:1", SHARED_STORAGE)]
    without_disk = _client(url)
    assert (await without_disk.lookup(["mem", "disk"])).disk_locations == [(), ()]
    await with_disk.close()
    await without_disk.close()


async def test_keys_the_master_cannot_be_asked_are_absent_and_the_rest_answered(aiohttp_free_server):
    seen: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        keys = request.query["keys"].split(",")
        seen.extend(keys)
        return web.json_response(_answer(keys, {k: _in_memory(ENDPOINT) for k in keys}))

    client = _client(await aiohttp_free_server(handle))
    asked = ["a,b", "plain", "with space+plus&amp%25", "plain"]
    lookup = await client.lookup(asked)
    assert lookup.status == "ok"
    assert lookup.locations == [(), (ENDPOINT,), (ENDPOINT,), (ENDPOINT,)]
    # Asked once each, decoded intact by the server; the key with "," never sent.
    assert seen == ["plain", "with space+plus&amp%25"]
    await client.close()


@pytest.mark.parametrize("chunked", [False, True])
async def test_an_answer_over_the_size_bound_is_a_store_failure_with_a_metric(aiohttp_free_server, chunked):
    # 2 MB: an answer a master with a huge replica list (or anything posing as one) could send.
    filler = {"ok": False, "error": "OBJECT_NOT_FOUND", "values": None, "note": "x" * 2_000_000}

    async def handle(request: web.Request) -> web.StreamResponse:
        keys = request.query["keys"].split(",")
        body = orjson.dumps({"success": True, "data": {**{k: _in_memory(ENDPOINT) for k in keys}, "pad": filler}})
        if not chunked:
            return web.Response(body=body, content_type="application/json")
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for at in range(0, len(body), 65536):
            await response.write(body[at:at + 65536])
        await response.write_eof()
        return response

    registry = CollectorRegistry()
    settings = SETTINGS.model_copy(update={"kvs_query_budget_ms": 2000, "kvs_retry_times": 0})
    client = _client(await aiohttp_free_server(handle), settings, registry, max_answer_bytes=1024 * 1024)
    lookup = await client.lookup(["k0", "k1"])
    assert lookup.status == "error" and lookup.locations == [(), ()]
    assert registry.get_sample_value("kvgate_kvs_oversized_answers_total", {"backend": "mooncake"}) == 1
    roomy = _client(await aiohttp_free_server(handle), settings, max_answer_bytes=4 * 1024 * 1024)
    assert (await roomy.lookup(["k0"])).locations == [(ENDPOINT,)]
    await client.close()
    await roomy.close()


async def test_only_the_first_blocks_are_asked(aiohttp_free_server):
    # Hits are contiguous from block 0, so a long prompt's first blocks decide its ranking.
    asked: list[str] = []

    async def handle(request: web.Request) -> web.Response:
        keys = request.query["keys"].split(",")
        asked.extend(keys)
        return web.json_response(_answer(keys, {k: _in_memory(ENDPOINT) for k in keys}))

    url = await aiohttp_free_server(handle)
    client = _client(url, SETTINGS.model_copy(update={"kvs_max_query_blocks": 10}))
    keys = [f"k{i}" for i in range(100)]
    lookup = await client.lookup(keys)
    assert asked == keys[:10]
    assert lookup.status == "ok" and lookup.locations == [(ENDPOINT,)] * 10 + [()] * 90
    await client.close()


@pytest.fixture
async def aiohttp_free_server() -> AsyncIterator:
    """start(handler) -> base URL of a real aiohttp server on a free loopback port serving it."""
    runners: list[web.AppRunner] = []

    async def start(handler) -> str:
        app = web.Application()
        app.router.add_get("/batch_query_keys", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        host, port = runner.addresses[0][:2]
        return f"http://{host}:{port}"

    yield start
    for runner in runners:
        await runner.cleanup()
