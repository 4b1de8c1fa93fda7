"""`kvgate demo` end to end on tiny settings, and its fleet wired to the real Mooncake master."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest

from kvgate.cli import main
from kvgate.config.settings import Settings
from kvgate.demo.fleet import FleetSpec, KVEventsSpec, running_fleet
from kvgate.demo.report import ROWS, format_table
from kvgate.demo.runner import run_demo
from kvgate.demo.workload import ConversationWorkload, conversation_requests
from kvgate.engine_model import ServiceProfile
from kvgate.gateway.planning.tokenizer import load_tokenizer
from kvgate.mock_engine.server import DEFAULT_MODEL, MockEngineConfig
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.key_formats import make_key_format


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def _spec(engines: int, master=None) -> FleetSpec:
    engine = MockEngineConfig(
        time_scale=0.5, profile=ServiceProfile(cache_capacity_blocks=64), settings=Settings()
    )
    return FleetSpec(engines, engine, master)


def test_conversations_grow_turn_by_turn_and_repeat_exactly():
    workload = ConversationWorkload(num_requests=40, num_documents=3, seed=7)
    requests = conversation_requests(workload)
    assert requests == conversation_requests(workload)
    assert len(requests) == 40
    assert [r.send_at_s for r in requests] == sorted(r.send_at_s for r in requests)
    # Every prompt starts with one of the documents, and most extend an earlier prompt (a later turn).
    starts = {r.prompt_token_ids[:2048] for r in requests}
    assert len(starts) <= 3
    extends = sum(
        any(
            len(p.prompt_token_ids) < len(r.prompt_token_ids)
            and r.prompt_token_ids[: len(p.prompt_token_ids)] == p.prompt_token_ids
            for p in requests[: r.index]
        )
        for r in requests
    )
    assert extends >= 10


async def test_demo_runs_both_policies_and_prints_the_table(tokenizer):
    workload = ConversationWorkload(
        num_requests=16,
        duration_s=1.0,
        num_documents=2,
        document_tokens=(1200, 2000),
        output_tokens=(2, 6),
        think_time_s=(0.2, 0.4),
        turns=(2, 3),
    )
    runs = await run_demo(_spec(2), conversation_requests(workload), tokenizer, progress=False)
    assert [run.policy for run in runs] == ["round_robin", "cache_aware"]
    for run in runs:
        assert run.summary.completed == 16 and not run.summary.errors
        assert run.summary.prompt_tokens == sum(
            len(r.prompt_token_ids) for r in conversation_requests(workload)
        )
    # Later turns go back to the engine holding their conversation.
    assert runs[1].summary.cached_tokens > 0
    lines = format_table(runs).splitlines()
    assert [cell.strip() for cell in lines[0].strip("|").split("|")] == ["", "round_robin", "cache_aware"]
    assert len(lines) == 2 + len(ROWS)
    assert all(label in "\n".join(lines) for label, _ in ROWS)


def six_request_trace(tmp_path) -> str:
    """Two 1536-token prompts sharing their first two 512-token blocks, sent three times each."""
    trace = tmp_path / "trace.jsonl"
    records = [
        {"timestamp": 100 * i, "input_length": 1536, "output_length": 4, "hash_ids": [0, 1, 2 + i % 2]}
        for i in range(6)
    ]
    trace.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return str(trace)


def test_demo_command_replays_a_trace(tmp_path, capsys):
    code = main(["demo", "--trace", six_request_trace(tmp_path), "--requests", "6", "--engines", "2",
                 "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0
    header = out.splitlines()[0]
    assert "round_robin" in header and "cache_aware" in header
    assert "6 / 6" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--engines", "0"],
        ["--requests", "0"],
        ["--time-scale", "0"],
        ["--cache-capacity-blocks", "0"],
        ["--trace", "/nonexistent/trace.jsonl"],
        ["--kvs-backend", "kv_events", "--mooncake"],
        ["--kvs-backend", "kv_events", "--prfaas"],
    ],
)
def test_demo_command_refuses_bad_arguments(argv, capsys):
    assert main(["demo", "--no-progress", *argv]) == 2
    assert capsys.readouterr().err


async def _master_holds(session: aiohttp.ClientSession, admin_url: str, keys: list[str]) -> bool:
    for _ in range(100):
        async with session.get(admin_url + "/batch_query_keys", params={"keys": ",".join(keys)}) as response:
            data = (await response.json(content_type=None))["data"]
        if all(data[key]["ok"] for key in keys):
            return True
        await asyncio.sleep(0.05)
    return False


@pytest.mark.mooncake
async def test_fleet_routes_on_blocks_the_mooncake_master_reports(mooncake_master, tokenizer):
    prompt = [random.Random(3).randrange(1000, 32000) for _ in range(3000)]
    settings = Settings()
    keys = make_key_format(settings).keys(
        hash_blocks(settings.kvs_hash_algo, prompt, settings.kvs_chunk_size)
    )
    spec = _spec(3, mooncake_master)
    async with (
        running_fleet(spec, "cache_aware", tokenizer) as url,
        aiohttp.ClientSession() as session,
    ):
        cached = []
        for turn in range(4):
            body = {"model": DEFAULT_MODEL, "prompt": prompt + [7] * turn, "max_tokens": 1}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, await response.text()
                cached.append((await response.json())["usage"]["prompt_tokens_details"]["cached_tokens"])
            if turn == 0:  # publication is asynchronous: wait until the master has the blocks
                assert await _master_holds(session, mooncake_master.admin_url, keys)
    # Published from 127.0.0.2-4, seen through the master, mapped back to the engine: every repeat hits.
    assert cached[0] == 0 and cached[1:] == [11 * 256] * 3


async def test_demo_prfaas_compares_local_pd_with_a_remote_prefill_cluster(tokenizer):
    from kvgate.config.settings import PDProtocol
    from kvgate.demo.prfaas import PrfaasDemo, run_prfaas_demo

    workload = ConversationWorkload(num_requests=12, duration_s=0.5, num_documents=3, document_tokens=(600, 4000),
                                    output_tokens=(2, 4), think_time_s=(0.1, 0.2), turns=(1, 3))
    local = FleetSpec(2, MockEngineConfig(time_scale=0.02), pd_protocol=PDProtocol.VLLM)
    runs = await run_prfaas_demo(local, PrfaasDemo(1, 10.0, 65536.0, 2400), conversation_requests(workload),
                                 tokenizer, progress=False)
    assert [run.policy for run in runs] == ["local PD 1P+1D", "PrfaaS +1 remote"]
    assert all(run.summary.completed == 12 and not run.summary.errors for run in runs)
    sent, total = (int(n) for n in runs[1].gateway["prefilled in the PrfaaS cluster"].split(" / "))
    assert total == 12 and 0 < sent < 12  # prompts of 2.1K-2.9K tokens: some cross, some stay
    table = format_table(runs)
    assert "prefilled in the PrfaaS cluster" in table and "KV sent over the link" in table
    assert runs[0].gateway == {}


def test_demo_prfaas_refuses_bad_arguments(capsys):
    assert main(["demo", "--prfaas", "--prfaas-engines", "0", "--no-progress"]) == 2
    assert "--prfaas-engines" in capsys.readouterr().err


async def test_fleet_on_kv_events_alone_routes_a_repeat_to_the_engine_that_published_its_blocks(tokenizer):
    """No store: the only way the gateway can know where the prompt is cached is the engines' events."""
    prompt = [random.Random(5).randrange(1000, 32000) for _ in range(3000)]
    spec = FleetSpec(2, MockEngineConfig(time_scale=0.05), kv_events=KVEventsSpec(), store=False)
    async with (
        running_fleet(spec, "cache_aware", tokenizer) as url,
        aiohttp.ClientSession() as session,
    ):
        body = {"model": DEFAULT_MODEL, "prompt": prompt, "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as response:
            assert response.status == 200, await response.text()
        for _ in range(200):  # the events arrive once the engine's step is over
            async with session.post(url + "/debug/schedule", json=body) as response:
                plan = await response.json()
            held = {i["id"]: i["prefix_hit_tokens"] for i in plan["instances"]}
            if max(held.values()) == 11 * 256:
                break
            await asyncio.sleep(0.05)
        assert plan["kvs_status"] == "skipped" and plan["events_status"] == "ok", plan
        assert sorted(held.values()) == [0, 11 * 256]
        holder = max(held, key=held.__getitem__)
        assert plan["selected"] == holder
        assert {i["id"]: i["hit_source"] for i in plan["instances"]}[holder] == "events"
        async with session.post(url + "/v1/completions", json=body) as response:
            usage = (await response.json())["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == 11 * 256


def test_a_fleet_without_a_store_needs_kv_events():
    with pytest.raises(ValueError, match="kv_events"):
        FleetSpec(2, MockEngineConfig(), store=False)


def test_demo_command_routes_on_kv_events_alone(tmp_path, capsys):
    code = main(["demo", "--kvs-backend", "kv_events", "--trace", six_request_trace(tmp_path), "--requests", "6",
                 "--engines", "2", "--no-progress"])
    captured = capsys.readouterr()
    assert code == 0
    assert "KV store: none, the engines' KV events alone" in captured.err
    assert "6 / 6" in captured.out
