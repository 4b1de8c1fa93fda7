"""The simulator's disaggregated fleets: the gateway's PD decision in virtual time."""

from __future__ import annotations

import json

import pytest

from kvgate.cli import main
from kvgate.config.settings import InstanceRole
from kvgate.simulator.pd_replay import PDReplay
from kvgate.simulator.profile import trace_profile
from kvgate.simulator.trace import read_trace
from tests.simulator.test_simulator import prefix_heavy_rows, settings
from tests.trace_helpers import write_trace

RATE = 50_000.0  # prompt tokens per second of KV transfer


def test_every_request_is_prefilled_then_decoded_and_nothing_stays_in_flight(tmp_path):
    trace = read_trace(write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(120)))
    replay = PDReplay(trace, settings("cache_aware"), 2, 2, trace_profile(cache_capacity_blocks=40),
                      kv_transfer_tokens_per_s=RATE, store_model="local")
    result = replay.run()
    assert result.summary.requests == len(trace)
    prefill = [i for i in replay.instances if i.config.role == InstanceRole.PREFILL]
    decode = [i for i in replay.instances if i.config.role == InstanceRole.DECODE]
    assert sum(i.requests for i in prefill) == sum(i.requests for i in decode) == len(trace)
    # Every first token comes from a decode instance after the prompt's transfer.
    assert all(ttft >= r.input_length / RATE for ttft, r in zip(result.ttfts, trace, strict=True))
    assert all(tbt > 0 for tbt in result.tbts) and len(result.tbts) == len(trace)  # 30 output tokens each
    assert replay.account.total_inflight() == 0 and len(replay.ledger) == 0
    # The decode engines computed only the partial last blocks: the rest arrived as KV.
    for inst in decode:
        stats = inst.engine.stats()
        assert stats.prefix_cache_queries - stats.prefix_cache_hits <= inst.requests * 512


def test_skip_prefill_sends_short_uncached_prompts_to_decode_alone(tmp_path):
    trace = read_trace(write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60)))
    replay = PDReplay(trace, settings("cache_aware", pd_skip_prefill_below_tokens=10**6), 1, 1,
                      trace_profile(cache_capacity_blocks=40), kv_transfer_tokens_per_s=RATE, store_model="local")
    replay.run()
    prefill, decode = replay.instances
    assert prefill.requests == 0 and decode.requests == len(trace)


def test_cli_compares_pd_with_as_many_neutral_instances(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(60))
    assert main(["simulate", "--trace", str(path), "--prefill-instances", "2", "--decode-instances", "1",
                 "--cache-capacity-blocks", "40", "--store-model", "local", "--json"]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [f["fleet"] for f in body["fleets"]] == ["neutral x3", "pd 2P+1D"]
    for fleet in body["fleets"]:
        assert fleet["requests"] == 60
        assert fleet["p50_ttft_s"] <= fleet["p90_ttft_s"] <= fleet["p99_ttft_s"]
        assert fleet["p50_tbt_ms"] <= fleet["p90_tbt_ms"] <= fleet["p99_tbt_ms"]
    assert main(["simulate", "--trace", str(path), "--prefill-instances", "2"]) == 2
    assert "go together" in capsys.readouterr().err


def test_a_disaggregated_replay_refuses_the_kv_events_backend(tmp_path):
    # No PD replay routes on KV events yet: a clear error, not a replay that asks a store it lacks.
    trace = read_trace(write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(10)))
    with pytest.raises(ValueError, match="neutral instances only"):
        PDReplay(trace, settings("cache_aware", kvs_backend="kv_events"), 1, 1, trace_profile(cache_capacity_blocks=40),
                 kv_transfer_tokens_per_s=RATE)
