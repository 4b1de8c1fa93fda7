"""The Mooncake backend against the real master: key encoding, and the master dying mid-run."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest

from kvgate.config.settings import Settings
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.mooncake import MooncakeMasterBackend
from kvgate.kvs_client.publisher_process import PublisherProcess
from tests.services import running_mooncake_master, store_client

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(120)]


def _client(admin_url: str, settings: Settings) -> ResilientKVSClient:
    backend = MooncakeMasterBackend(admin_url, request_timeout_s=settings.kvs_query_budget_ms / 1000)
    return ResilientKVSClient(backend, settings)


async def test_keys_in_every_engine_format_round_trip_through_the_master(mooncake_master, tmp_path):
    run = uuid.uuid4().hex[:8]
    # Shapes engines really write (REFERENCE.md section 2) plus characters a URL would mangle.
    keys = [
        f"{run}c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb_0",
        f"{run}sglang_Qwen-Qwen3-8B_cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72_0_k",
        f"prefix@{run}Qwen3-8B@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@0a1b",
        f"vllm@org/model@1@0@{run}ff@bfloat16",
        f"{run}odd key+plus&amp=eq%25pct?q#h",
    ]
    client = _client(mooncake_master.admin_url, Settings(kvs_query_budget_ms=2000))
    with store_client(mooncake_master, "127.0.0.4", tmp_path) as holder:
        assert holder.publish(keys) == []
        lookup = await client.lookup([*keys, f"{run}absent", f"{run}with,comma"])
        assert lookup.status == "ok"
        assert lookup.locations == [(holder.endpoint,)] * len(keys) + [(), ()]
    await client.close()


def _freeze(pid: int) -> None:
    """SIGSTOP and wait until every thread is stopped (delivery is asynchronous)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        states = {Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                  for tid in os.listdir(f"/proc/{pid}/task")}
        if states == {"T"}:
            return
        time.sleep(0.01)
    raise AssertionError(f"process {pid} did not stop: thread states {states}")


async def test_master_frozen_then_killed_mid_run(tmp_path):
    """SIGSTOP: connections hang (timeouts); SIGCONT: recovery by probe; SIGKILL: refused connections."""
    budget_ms = 200
    down_s = 0.5
    settings = Settings(
        kvs_query_budget_ms=budget_ms, kvs_retry_times=2, kvs_retry_interval_ms=20,
        kvs_metadata_service_down_duration_s=down_s,
    )
    with running_mooncake_master(tmp_path) as master:
        # A child we can SIGKILL: a store client whose master died takes ~17 s to close cleanly.
        holder = PublisherProcess("127.0.0.5", master.rpc_address, master.metadata_url, tmp_path / "holder.log")
        client = _client(master.admin_url, settings)
        try:
            key = f"{uuid.uuid4().hex}_0"
            assert holder.publish([key]) == []
            held = [(holder.endpoint,), ()]
            before = await client.lookup([key, "absent"])
            assert (before.status, before.locations) == ("ok", held)

            _freeze(master.process.pid)
            try:
                for _ in range(1 + settings.kvs_retry_times):
                    frozen = await client.lookup([key, "absent"])
                    assert (frozen.status, frozen.locations) == ("error", [(), ()])
                    assert frozen.elapsed_s < budget_ms / 1000 + 0.2
                assert client.is_down, "three timeouts in a row mark the store down"
                assert (await client.lookup([key])).status == "down"
            finally:
                os.kill(master.process.pid, signal.SIGCONT)

            await asyncio.sleep(down_s + 0.05)
            recovered = await client.lookup([key, "absent"])
            assert (recovered.status, recovered.locations) == ("ok", held)
            assert not client.is_down

            master.kill()
            killed = await client.lookup([key, "absent"])
            assert (killed.status, killed.locations) == ("error", [(), ()])
            assert killed.elapsed_s < budget_ms / 1000 + 0.2
            assert client.is_down, "connection refused three times in a row marks the store down"
            assert (await client.lookup([key])).status == "down"
        finally:
            holder.kill()
            await client.close()


async def test_only_the_first_blocks_are_asked_of_the_real_master(mooncake_master, tmp_path):
    run = uuid.uuid4().hex[:8]
    keys = [f"{run}block{i}" for i in range(6)]
    settings = Settings(kvs_query_budget_ms=2000, kvs_max_query_blocks=4)
    client = _client(mooncake_master.admin_url, settings)
    with store_client(mooncake_master, "127.0.0.5", tmp_path) as holder:
        assert holder.publish(keys) == []
        lookup = await client.lookup(keys)
        # Every block is held, but only the first 4 were asked: the rest count as held nowhere.
        assert lookup.status == "ok"
        assert lookup.locations == [(holder.endpoint,)] * 4 + [()] * 2
    await client.close()
