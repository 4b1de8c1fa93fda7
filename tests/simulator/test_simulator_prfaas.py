"""The simulator's PrfaaS fleets: the gateway's cluster rule in virtual time, over a link that queues."""

from __future__ import annotations

import json

import pytest

from kvgate.cli import main
from kvgate.simulator.prfaas_replay import PrfaasReplay
from kvgate.simulator.profile import trace_profile
from kvgate.simulator.synthetic import lognormal_requests
from kvgate.simulator.trace import read_trace
from tests.simulator.test_simulator import prefix_heavy_rows, settings
from tests.trace_helpers import write_trace

KV_BYTES = 20_000  # per token
PRFAAS = {"prfaas_cluster": "remote", "prfaas_kv_bytes_per_token": KV_BYTES, "prfaas_threshold_tokens": 2048,
          "prfaas_threshold_min_tokens": 1024, "prfaas_threshold_max_tokens": 8192}


def replay(trace, naive=False, gbps=10.0, **fields) -> PrfaasReplay:
    return PrfaasReplay(trace, settings("cache_aware", **PRFAAS, prfaas_egress_gbps=gbps, **fields), 1, 1, 2,
                        trace_profile(cache_capacity_blocks=40), naive=naive, store_model="local")


def test_offloaded_prompts_cross_the_link_and_nothing_stays_in_flight():
    trace = lognormal_requests(60, 0.5, 8.0, 1.0, 128, 16384, 20, seed=3)
    sim = replay(trace)
    outcome = sim.run_prfaas()
    assert outcome.result.summary.requests == len(trace)
    remote = [i for i in sim.instances if i.config.cluster == "remote"]
    offloaded = sum(i.requests for i in remote)
    assert offloaded == outcome.link.offloaded > 0 and outcome.link.decided == len(trace)
    # No prefix is shared: only prompts above the lowest threshold cross, each once with its whole KV.
    assert offloaded <= sum(r.input_length > 1024 for r in trace)
    remote_prompt_tokens = sum(i.engine.stats().prefix_cache_queries for i in remote)
    assert outcome.link.egress_bytes == remote_prompt_tokens * KV_BYTES
    assert outcome.link.busy_s == pytest.approx(outcome.link.egress_bytes / (10e9 / 8))
    assert sim.account.total_inflight() == 0 and len(sim.ledger) == 0


def test_the_naive_rule_sends_every_long_prompt_and_ignores_cached_prefixes(tmp_path):
    # Requests reading one of a few 4096-token documents, each with its own 512-token question.
    trace = read_trace(write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(80)))
    naive = replay(trace, naive=True, prfaas_bandwidth_mode="abundant").run_prfaas()
    rule = replay(trace, prfaas_bandwidth_mode="abundant").run_prfaas()
    assert naive.link.offloaded == len(trace) and naive.link.final_threshold_tokens == 2048
    # The rule counts the cached document wherever it lies: once cached, only the question is new.
    assert rule.link.offloaded < len(trace) // 2


def test_a_slower_link_queues_transfers_and_raises_the_threshold():
    trace = lognormal_requests(60, 2.0, 8.5, 0.5, 1024, 16384, 10, seed=1)
    fast = replay(trace, gbps=100.0, prfaas_adapt_interval_s=1.0).run_prfaas()
    slow = replay(trace, gbps=0.5, prfaas_adapt_interval_s=1.0).run_prfaas()
    assert slow.result.summary.p90_ttft_s > fast.result.summary.p90_ttft_s
    assert slow.link.final_threshold_tokens > 2048  # the saturated link pushed prompts back home
    assert slow.link.offloaded < fast.link.offloaded


def test_cli_compares_local_pd_naive_and_prfaas(tmp_path, capsys):
    common = ["--prefill-instances", "1", "--decode-instances", "1", "--prfaas-instances", "1",
              "--prfaas-egress-gbps", "10", "--prfaas-kv-bytes-per-token", str(KV_BYTES),
              "--prfaas-threshold-tokens", "2048", "--cache-capacity-blocks", "40", "--store-model", "local", "--json"]
    assert main(["simulate", "--lognormal", "8,1,128,16384", "--limit", "30", *common]) == 0
    body = json.loads(capsys.readouterr().out)
    assert [f["fleet"] for f in body["fleets"]] == ["local PD 1P+1D", "naive 1P+1D+1R", "prfaas 1P+1D+1R"]
    for fleet in body["fleets"]:
        assert fleet["requests"] == 30 and fleet["p50_ttft_s"] <= fleet["p90_ttft_s"]
    assert body["fleets"][0]["link_utilisation"] is None and body["fleets"][1]["egress_gbps"] > 0
    path = write_trace(tmp_path / "t.jsonl", prefix_heavy_rows(30))
    assert main(["simulate", "--trace", str(path), *common]) == 0
    assert len(json.loads(capsys.readouterr().out)["fleets"]) == 3
    assert main(["simulate", *common]) == 2
    assert "--trace FILE or --lognormal" in capsys.readouterr().err
    assert main(["simulate", "--lognormal", "8,1", *common]) == 2
    assert "MU,SIGMA,MIN,MAX" in capsys.readouterr().err
