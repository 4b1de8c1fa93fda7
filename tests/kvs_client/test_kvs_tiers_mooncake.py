"""Tiered hits from the real Mooncake master: two store clients, replicas placed by replica_num,
and a block held only on the other instance's segment priced as a transfer, not a miss."""

from __future__ import annotations

import uuid

import pytest

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import Candidate, InstanceLoad
from tests.services import store_clients

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]

CHUNK = 16


async def test_replicas_on_two_segments_and_a_transfer_from_the_other_one(mooncake_master, tmp_path):
    settings = Settings(
        dispatch_policy="conductor", kvs_chunk_size=CHUNK, cache_aware_scheduling_min_tokens=0,
        kvs_query_budget_ms=2000, hash_seed=uuid.uuid4().hex,  # keys of this run only
        ttft_prefill_points=((1000, 1.0),), kv_bytes_per_token=100_000, kv_network_bandwidth_gb_s=1.0,
    )
    backend = MooncakeMasterBackend(mooncake_master.admin_url, request_timeout_s=2.0)
    client = ResilientKVSClient(backend, settings)
    with store_clients(mooncake_master, ["127.0.0.5", "127.0.0.6"], tmp_path) as (seg_a, seg_b):
        instances = (
            InstanceConfig(id="a", url="http://127.0.0.5:8000", model="m", kvs_endpoints=(seg_a.endpoint,)),
            InstanceConfig(id="b", url="http://127.0.0.6:8000", model="m", kvs_endpoints=(seg_b.endpoint,)),
        )
        scheduler = Scheduler(settings, instances)
        blocks = scheduler.block_hashes(list(range(8 * CHUNK)))
        keys = scheduler.block_keys(blocks)
        # Blocks 0-3 with two replicas (a's segment and the other one), 4-7 on a's segment alone;
        # b's later put of a held key adds no replica.
        assert seg_a.publish(keys[:4], replica_num=2) == []
        assert seg_a.publish(keys[4:]) == []
        assert seg_b.publish(keys[4:]) == []

        lookup = await client.lookup(keys)
        assert lookup.status == "ok"
        assert [set(endpoints) for endpoints in lookup.locations] == (
            [{seg_a.endpoint, seg_b.endpoint}] * 4 + [{seg_a.endpoint}] * 4
        )
        idle = InstanceLoad()
        candidates = [Candidate("a", instances[0].role, idle), Candidate("b", instances[1].role, idle)]
        decision = scheduler.decide(len(blocks) * CHUNK, blocks, lookup.locations, candidates)
        a, b = decision.predictions["a"], decision.predictions["b"]
        assert (a.local_hit_tokens, a.transfer_tokens) == (8 * CHUNK, 0)
        # b holds the replicated half itself; the rest is on a's segment only: a transfer
        # (all but the last token, which is computed), not a miss.
        assert b.local_hit_tokens == 4 * CHUNK
        assert b.transfer_tokens == 4 * CHUNK - 1 and b.transfer_s > 0
        assert b.prefill_s == a.prefill_s  # both start from the whole prefix
        assert decision.selected == "a"  # same queue: the holder needs no transfer
    await client.close()
