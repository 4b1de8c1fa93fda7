"""`kvgate doctor` on a fleet routed by KV events alone: no store to probe, the engines still checked."""

from __future__ import annotations

import pytest

from kvgate.commands.doctor import diagnose
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.engine_model import ServiceProfile
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.mock_engine.server import DEFAULT_MODEL, MockEngineConfig, start_mock_engine
from kvgate.processes import free_port
from tests.gateway_helpers import tokenizer

pytestmark = pytest.mark.timeout(60)


async def test_doctor_checks_keys_in_the_engines_events_without_a_store():
    engine_settings = Settings(kvs_chunk_size=16)
    handle = await start_mock_engine(
        MockEngineConfig(time_scale=0.0, settings=engine_settings, profile=ServiceProfile().with_block_size(16)),
        tokenizer=TokenizerService(tokenizer()))
    try:
        silent = f"tcp://127.0.0.1:{free_port()}"  # nothing publishes there
        settings = Settings(kvs_backend=KVSBackendName.KV_EVENTS, kvs_chunk_size=16, instances=(
            InstanceConfig(id="e0", url=handle.url, model=DEFAULT_MODEL, kv_events_endpoint=silent),))
        results = {(r.check, r.subject): r for r in await diagnose(settings, TokenizerService(tokenizer()),
                                                                   timeout_s=10, store_wait_s=1)}
        # No store to reach: the keys are checked in the engine's own KV events instead, and an
        # engine that publishes none at its endpoint is named.
        store = results[("KV store", "store")]
        assert store.passed and "KV events" in store.detail
        assert results[("serves the model", "e0")].passed
        assert ("block keys in store", "e0") not in results
        events = results[("block keys in KV events", "e0")]
        assert not events.passed and silent in events.detail
    finally:
        await handle.close()
