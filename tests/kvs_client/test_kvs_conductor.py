"""The Conductor indexer backend against a conformance double of its documented HTTP API.

Mooncake's Conductor cannot be installed here (no package ships it); tests/conductor_double.py
implements its `/query` contract over a real prefix table. These tests check what kvgate asks,
how the per-instance, per-medium answer becomes the per-block view the scheduler prices, and that a
failing or misbehaving indexer is only a miss.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import orjson
import pytest
from prometheus_client import CollectorRegistry

from kvgate.cli import main
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.kvs_client import HashedPrompt, KVSQueryError, ResilientKVSClient, make_backend, make_kvs_client
from kvgate.kvs_client.conductor_indexer import InstancePrefix, parse_answer, to_key_view
from kvgate.metrics.definitions import kvs_metrics
from kvgate.scheduler.prefix import prefix_hit_tokens
from kvgate.scheduler.router import Scheduler
from tests.conductor_double import ConductorDouble
from tests.gateway_helpers import closed_port_url

pytestmark = pytest.mark.timeout(60)

CHUNK = 16
MODEL = "qwen"
# Four and a half blocks: with save_unfull_chunk the fifth key is the partial block.
PROMPT = list(range(1000, 1000 + 4 * CHUNK + CHUNK // 2))


def settings_for(url: str, **overrides) -> Settings:
    values = {
        "kvs_backend": KVSBackendName.CONDUCTOR, "kvs_conductor_url": url, "kvs_chunk_size": CHUNK,
        "kvs_enable_save_unfull_chunk": True, "kvs_query_budget_ms": 2000, "kvs_retry_times": 0,
    }
    return Settings(**{**values, **overrides})


def keys_of(settings: Settings, token_ids: list[int]) -> list[str]:
    scheduler = Scheduler(settings, [])
    return scheduler.block_keys(scheduler.block_hashes(token_ids))


@pytest.fixture
async def conductor() -> AsyncIterator[ConductorDouble]:
    double = await ConductorDouble().start()
    yield double
    await double.close()


# --- what is asked ---


async def test_the_query_carries_the_documented_fields(conductor):
    settings = settings_for(conductor.url, kvs_conductor_tenant="team-a", kvs_conductor_lora_name="sql-adapter",
                            kvs_conductor_cache_salt="w8a8")
    client = make_kvs_client(settings)
    keys = keys_of(settings, PROMPT)
    assert (await client.lookup(keys, PROMPT, MODEL)).status == "ok"
    # Complete blocks only, and no instance_id: every instance registered under the tenant answers.
    assert conductor.requests[-1] == {"model": MODEL, "token_ids": PROMPT[: 4 * CHUNK], "block_size": CHUNK,
                                      "tenant_id": "team-a", "lora_name": "sql-adapter", "cache_salt": "w8a8"}
    await client.close()

    # Unset LoRA and salt are left out (the base model, no salt); a configured model wins over the request's.
    client = make_kvs_client(settings_for(conductor.url, kvs_conductor_model="registered-name"))
    await client.lookup(keys, PROMPT, MODEL)
    assert conductor.requests[-1] == {"model": "registered-name", "token_ids": PROMPT[: 4 * CHUNK], "block_size": CHUNK,
                                      "tenant_id": "default"}
    await client.close()


async def test_only_the_asked_blocks_tokens_are_sent(conductor):
    settings = settings_for(conductor.url, kvs_max_query_blocks=2)
    conductor.store("e0", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert conductor.requests[-1]["token_ids"] == PROMPT[: 2 * CHUNK]
    assert lookup.locations == [("e0",), ("e0",), (), (), ()]
    await client.close()


async def test_a_prompt_shorter_than_a_block_is_not_asked(conductor):
    settings = settings_for(conductor.url)
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT[:5]), PROMPT[:5], MODEL)
    assert (lookup.status, lookup.locations, conductor.requests) == ("ok", [()], [])
    await client.close()


# --- how the answer maps to tiers ---

# (what the indexer's table holds: (instance, medium, complete blocks), --kvs-query-disk-tier,
#  expected memory holders per key, expected disk-only holders per key). PROMPT has 4 complete
#  blocks and a partial fifth, which the indexer never matches.
TIER_CASES = {
    "gpu": ([("a", "gpu", 4)], False, ["a", "a", "a", "a", ""], [""] * 5),
    "cpu prefix": ([("a", "cpu", 2)], False, ["a", "a", "", "", ""], [""] * 5),
    "gpu then cpu": ([("a", "gpu", 2), ("a", "cpu", 4)], True, ["a"] * 4 + [""], [""] * 5),
    "disk only, tier off": ([("a", "disk", 3)], False, [""] * 5, [""] * 5),
    "disk only, tier on": ([("a", "disk", 3)], True, [""] * 5, ["a", "a", "a", "", ""]),
    "gpu block then disk": ([("a", "gpu", 1), ("a", "disk", 3)], True, ["a", "", "", "", ""],
                            ["", "a", "a", "", ""]),
    "two instances": ([("a", "gpu", 2), ("b", "cpu", 4)], False, ["ab", "ab", "b", "b", ""], [""] * 5),
    "memory here, disk there": ([("a", "gpu", 2), ("a", "disk", 4), ("b", "cpu", 3)], True,
                                ["ab", "ab", "b", "", ""], ["", "", "a", "a", ""]),
    "unknown medium priced as disk": ([("a", "external", 3)], True, [""] * 5, ["a", "a", "a", "", ""]),
    "cpu_pinned is memory": ([("a", "cpu_pinned", 2)], True, ["a", "a", "", "", ""], [""] * 5),
    "registered, holds nothing": ([("a", "gpu", 0)], True, [""] * 5, [""] * 5),
}


@pytest.mark.parametrize("case", TIER_CASES)
async def test_media_become_memory_and_disk_holders_per_block(conductor, case):
    table, disk_tier, memory, disk = TIER_CASES[case]
    for instance, medium, blocks in table:
        conductor.store(instance, PROMPT[: blocks * CHUNK], medium, model=MODEL, block_size=CHUNK)
    settings = settings_for(conductor.url, kvs_query_disk_tier=disk_tier)
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert lookup.status == "ok"
    assert ["".join(holders) for holders in lookup.locations] == memory
    assert ["".join(holders) for holders in lookup.disk_locations] == disk
    await client.close()


async def test_an_eviction_the_indexer_hears_of_ends_the_hit(conductor):
    conductor.store("a", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    conductor.store("a", PROMPT[: 2 * CHUNK], "cpu", model=MODEL, block_size=CHUNK)
    settings = settings_for(conductor.url)
    client = make_kvs_client(settings)
    keys = keys_of(settings, PROMPT)
    assert (await client.lookup(keys, PROMPT, MODEL)).hit_count == 4
    conductor.remove("a", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    assert (await client.lookup(keys, PROMPT, MODEL)).locations == [("a",), ("a",), (), (), ()]
    await client.close()


# Answers the double does not produce but the documented contract allows (and the cumulative
# GPU -> CPU -> DISK boundaries some Conductor versions report): instance entry -> (memory, held).
ANSWER_CASES = {
    "documented example": ({"longest_matched": 256, "GPU": 128, "DP": {"0": 128, "1": 256}, "CPU": 256,
                            "DISK": 0}, (256, 256)),
    "lower-case names": ({"longest_matched": 192, "gpu": 64, "cpu": 128, "disk": 192}, (128, 192)),
    "cumulative boundaries": ({"longest_matched": 384, "GPU": 128, "CPU": 256, "DISK": 384}, (256, 384)),
    "held beyond every medium": ({"longest_matched": 256, "GPU": 64, "CPU": 0, "DISK": 0}, (64, 256)),
    "a new medium": ({"longest_matched": 128, "GPU": 0, "CXL_POOL": 128}, (0, 128)),
    "per-rank detail is no medium": ({"longest_matched": 64, "GPU": 64, "rank_matches": [{"gpu": 64}]},
                                     (64, 64)),
}


@pytest.mark.parametrize("case", ANSWER_CASES)
def test_answer_fields_read_as_prefixes(case):
    entry, (memory, held) = ANSWER_CASES[case]
    assert parse_answer({"default": {"x": entry}}, "default", 512) == {"x": InstancePrefix(memory, held)}


def test_key_view_walks_spans_between_prefix_ends():
    keys = [f"k{i}" for i in range(6)]
    prefixes = {"a": InstancePrefix(4 * CHUNK, 4 * CHUNK), "b": InstancePrefix(CHUNK, 5 * CHUNK),
                "c": InstancePrefix(0, 0)}
    answer = to_key_view(prefixes, keys, CHUNK, include_disk_tier=True)
    assert answer.locations == {"k0": ("a", "b"), "k1": ("a",), "k2": ("a",), "k3": ("a",)}
    assert answer.disk_locations == {"k1": ("b",), "k2": ("b",), "k3": ("b",), "k4": ("b",)}
    # A prefix that ends inside a block does not hold that block.
    assert to_key_view({"a": InstancePrefix(CHUNK + 3, CHUNK + 3)}, keys, CHUNK, False).locations == {"k0": ("a",)}


async def test_other_tenants_and_instances_outside_the_fleet_are_not_hits(conductor):
    conductor.store("a", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    conductor.store("z", PROMPT, "gpu", model=MODEL, block_size=CHUNK, tenant="other-team")
    conductor.store("engine-b-dp", PROMPT[: 3 * CHUNK], "cpu", model=MODEL, block_size=CHUNK)
    conductor.store("ghost", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    conductor.store("b", PROMPT, "gpu", model=MODEL, block_size=CHUNK)  # not b's name: it has kvs_endpoints
    conductor.store("a", PROMPT, "gpu", model="another-model", block_size=CHUNK)
    settings = settings_for(conductor.url)
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert lookup.locations[0] == ("a", "b", "engine-b-dp", "ghost")  # tenant "default" only

    # Instances are known by their own id, or by the indexer ids their kvs_endpoints name; an id
    # no instance claims ("ghost") is no one's hit.
    instances = [InstanceConfig(id="a", url="http://127.0.0.1:1", model=MODEL),
                 InstanceConfig(id="b", url="http://127.0.0.1:2", model=MODEL, kvs_endpoints=("engine-b-dp",))]
    scheduler = Scheduler(settings, instances)
    blocks = scheduler.block_hashes(PROMPT)
    hits = prefix_hit_tokens(blocks, lookup.locations, scheduler.endpoint_map, len(PROMPT))
    assert hits == {"a": 4 * CHUNK, "b": 3 * CHUNK}
    await client.close()


# --- failures are misses ---

MALFORMED = {
    "not JSON": b"{\"default\": {",
    "a list": b"[1, 2]",
    "tenant not an object": orjson.dumps({"default": []}),
    "instance not an object": orjson.dumps({"default": {"a": 64}}),
    "negative count": orjson.dumps({"default": {"a": {"longest_matched": -16}}}),
    "fractional count": orjson.dumps({"default": {"a": {"longest_matched": 16.0}}}),
    "count as text": orjson.dumps({"default": {"a": {"longest_matched": "16"}}}),
    "count as boolean": orjson.dumps({"default": {"a": {"longest_matched": True}}}),
    "null medium": orjson.dumps({"default": {"a": {"longest_matched": 16, "GPU": None}}}),
    "no longest_matched": orjson.dumps({"default": {"a": {"GPU": 16}}}),
    "more than was asked": orjson.dumps({"default": {"a": {"longest_matched": 10 * CHUNK}}}),
}


@pytest.mark.parametrize("case", MALFORMED)
async def test_a_malformed_answer_is_a_query_error(conductor, case):
    conductor.fail_with = (200, MALFORMED[case])
    settings = settings_for(conductor.url)
    backend = make_backend(settings)
    with pytest.raises(KVSQueryError):
        await backend.query(keys_of(settings, PROMPT), HashedPrompt(PROMPT, MODEL))
    lookup = await ResilientKVSClient(backend, settings).lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert (lookup.status, lookup.locations) == ("error", [()] * 5)
    await backend.close()


@pytest.mark.parametrize("status", [400, 404, 500, 503])
async def test_an_http_error_is_a_query_error(conductor, status):
    conductor.fail_with = (status, b'{"error": "no"}')
    settings = settings_for(conductor.url)
    backend = make_backend(settings)
    with pytest.raises(KVSQueryError, match=f"HTTP {status}"):
        await backend.query(keys_of(settings, PROMPT), HashedPrompt(PROMPT, MODEL))
    await backend.close()


async def test_an_answer_beyond_the_size_bound_is_not_read(conductor):
    instances = {f"instance-{i:04d}": {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0} for i in range(200)}
    conductor.fail_with = (200, orjson.dumps({"default": instances}))
    settings = settings_for(conductor.url, kvs_max_answer_bytes=4096)
    registry = CollectorRegistry()
    client = ResilientKVSClient(make_backend(settings), settings, kvs_metrics(registry))
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert lookup.status == "error" and "--kvs-max-answer-bytes" in (client.last_error or "")
    assert registry.get_sample_value("kvgate_kvs_oversized_answers_total", {"backend": "conductor"}) == 1
    await client.close()


async def test_a_lookup_without_token_ids_or_model_cannot_be_asked(conductor):
    settings = settings_for(conductor.url)
    keys = keys_of(settings, PROMPT)
    for token_ids, model, error in ((None, MODEL, "token ids"), (PROMPT, "", "kvs_conductor_model")):
        client = make_kvs_client(settings)
        assert (await client.lookup(keys, token_ids, model)).status == "error"
        assert error in (client.last_error or "")
        await client.close()
    assert conductor.requests == []


async def test_a_failing_indexer_is_marked_down_skipped_then_probed_back(conductor):
    now = [0.0]
    settings = settings_for(conductor.url, kvs_retry_times=1, kvs_retry_interval_ms=0,
                            kvs_metadata_service_down_duration_s=30)
    client = ResilientKVSClient(make_backend(settings), settings, clock=lambda: now[0])
    keys = keys_of(settings, PROMPT)
    conductor.store("a", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    conductor.fail_with = (500, b"{}")
    assert (await client.lookup(keys, PROMPT, MODEL)).status == "error"  # two failed attempts
    assert client.is_down
    asked = len(conductor.requests)
    assert (await client.lookup(keys, PROMPT, MODEL)).status == "down"
    assert len(conductor.requests) == asked  # not asked while down

    conductor.fail_with = None
    now[0] = 31.0
    probe = await client.lookup(keys, PROMPT, MODEL)
    assert (probe.status, probe.locations[0]) == ("ok", ("a",))
    assert not client.is_down
    await client.close()


async def test_a_slow_indexer_costs_a_lookup_its_budget_only(conductor):
    conductor.store("a", PROMPT, "gpu", model=MODEL, block_size=CHUNK)
    conductor.delay_s = 0.5
    settings = settings_for(conductor.url, kvs_query_budget_ms=100)
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert (lookup.status, lookup.locations) == ("error", [()] * 5)
    # The budget or the session's own timeout (set to the budget) ends the call, whichever fires first.
    assert client.last_error in ("time budget exhausted", f"KVSQueryError: POST {conductor.url}/query: TimeoutError: ")
    await client.close()


async def test_an_unreachable_indexer_is_an_error_lookup():
    settings = settings_for(closed_port_url())
    client = make_kvs_client(settings)
    lookup = await client.lookup(keys_of(settings, PROMPT), PROMPT, MODEL)
    assert lookup.status == "error" and "ClientConnectorError" in (client.last_error or "")
    await client.close()


def test_the_indexer_url_must_be_http():
    with pytest.raises(ValueError, match="http"):
        Settings(kvs_backend=KVSBackendName.CONDUCTOR, kvs_conductor_url="127.0.0.1:13333")
    assert Settings(kvs_conductor_url="http://indexer:13333/").kvs_conductor_url == "http://indexer:13333"


def test_check_config_names_the_indexer_and_the_ids_it_knows_instances_by(tmp_path, capsys):
    config = tmp_path / "kvgate.yaml"
    config.write_text("instances:\n"
                      "  - {id: a, url: 'http://127.0.0.1:8001', model: qwen}\n"
                      "  - {id: b, url: 'http://127.0.0.1:8002', model: qwen, kvs_endpoints: [engine-b-dp]}\n")
    argv = ["serve", "--config", str(config), "--kvs-backend", "conductor", "--kvs-conductor-url",
            "http://127.0.0.1:13333", "--kvs-conductor-tenant", "team-a", "--check-config"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "kv store:    conductor indexer http://127.0.0.1:13333, tenant team-a, model the request's" in out
    assert "kvs_endpoints=a" in out and "kvs_endpoints=engine-b-dp" in out
    assert main(argv[:-3] + ["--kvs-conductor-url", "indexer:13333", "--check-config"]) == 2
    assert "--kvs-conductor-url (from command line)" in capsys.readouterr().err
