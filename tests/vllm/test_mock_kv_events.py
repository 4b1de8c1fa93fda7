"""vLLM's own event classes decode a mock engine's KV events: run by the engines' virtualenv (the
`engine_venv` fixture: vLLM 0.32), in a subprocess, on bytes a mock engine really sent. No engine starts.

Maps (vLLM 0.32) must decode with `KVEventBatch` and re-encode to the very same bytes; arrays (older
vLLM) must decode with array-like variants of the same classes (same fields, same order).
"""

from __future__ import annotations

import json
import os
import subprocess

import aiohttp
import zmq.asyncio

from kvgate.engines.install import EngineVenv
from kvgate.mock_engine.kv_events import KVEventsOptions
from kvgate.mock_engine.server import start_mock_engine
from kvgate.processes import free_port
from tests.kv_events_client import complete, replay
from tests.mock_engine.test_mock_engine_kv_events import BLOCK, _config, _prompt, _vllm_hashes

# Run by vLLM's interpreter: decode each payload, print what vLLM's classes saw.
_DECODE = r"""
import json, sys
import msgspec
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, KVEventBatch

class ArrayStored(BlockStored, array_like=True, tag="BlockStored"): pass
class ArrayRemoved(BlockRemoved, array_like=True, tag="BlockRemoved"): pass
class ArrayCleared(AllBlocksCleared, array_like=True, tag="AllBlocksCleared"): pass
class ArrayBatch(EventBatch):
    events: list[ArrayStored | ArrayRemoved | ArrayCleared]

decoders = {"map": msgspec.msgpack.Decoder(KVEventBatch), "array": msgspec.msgpack.Decoder(ArrayBatch)}
out = []
for item in json.load(sys.stdin):
    payload = bytes.fromhex(item["payload"])
    batch = decoders[item["encoding"]].decode(payload)
    events = []
    for event in batch.events:
        fields = {k: v for k, v in zip(event.__struct_fields__, msgspec.structs.astuple(event))}
        if "block_hashes" in fields:
            fields["block_hashes"] = [h.hex() if isinstance(h, bytes) else h for h in fields["block_hashes"]]
        parent = fields.get("parent_block_hash")
        if isinstance(parent, bytes):
            fields["parent_block_hash"] = parent.hex()
        events.append({"class": type(event).__mro__[0 if item["encoding"] == "map" else 1].__name__, **fields})
    out.append({"rank": batch.data_parallel_rank, "same_bytes": msgspec.msgpack.encode(batch) == payload,
                "events": events})
print(json.dumps(out))
"""


def _as_json(value):
    return value.hex() if isinstance(value, bytes) else value


async def test_vllm_decodes_the_mock_engines_events(engine_venv: EngineVenv):
    prompt = _prompt(3 * BLOCK, seed=5)
    sent = []
    ctx = zmq.asyncio.Context()
    try:
        async with aiohttp.ClientSession() as session:
            for encoding in ("map", "array"):
                for hash_format in ("int", "bytes"):
                    replay_endpoint = f"tcp://127.0.0.1:{free_port()}"
                    options = KVEventsOptions(f"tcp://127.0.0.1:{free_port()}", replay_endpoint=replay_endpoint,
                                              encoding=encoding, hash_format=hash_format)
                    engine = await start_mock_engine(_config(options, capacity_blocks=4))
                    try:
                        await complete(session, engine.url, prompt)  # stored
                        await complete(session, engine.url, _prompt(3 * BLOCK, seed=6))  # evicts: removed
                        async with session.post(engine.url + "/reset_prefix_cache") as response:
                            assert (await response.json())["success"]
                        batches, _ = await replay(ctx, replay_endpoint, 0)
                    finally:
                        await engine.close()
                    sent += [{"encoding": encoding, "hash": hash_format, "payload": b.payload.hex()} for b in batches]
    finally:
        ctx.term()

    run = subprocess.run([str(engine_venv.python), "-c", _DECODE], input=json.dumps(sent), capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": ""})
    assert run.returncode == 0, run.stderr[-3000:]
    decoded = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(decoded) == len(sent) == 4 * 3
    for item, batch in zip(sent, decoded, strict=True):
        assert batch["rank"] == 0
        if item["encoding"] == "map":
            assert batch["same_bytes"], "vLLM's encoder writes these events differently"
    expected = {fmt: [_as_json(h) for h in _vllm_hashes(prompt, fmt)] for fmt in ("int", "bytes")}
    for i in range(0, len(sent), 3):
        fmt = sent[i]["hash"]
        stored, evicting, cleared = (batch["events"] for batch in decoded[i : i + 3])
        assert stored == [{
            "class": "BlockStored", "block_hashes": expected[fmt], "parent_block_hash": None,
            "token_ids": prompt, "block_size": BLOCK, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": None, "group_idx": 0, "kv_cache_spec_kind": "full_attention",
            "kv_cache_spec_sliding_window": None, "locality": None, "ownership": None, "session_id": None,
        }]
        removed = [event for event in evicting if event["class"] == "BlockRemoved"]
        assert [event["block_hashes"][0] for event in removed] == expected[fmt][: len(removed)] and removed
        assert evicting[-1]["class"] == "BlockStored"
        assert cleared == [{"class": "AllBlocksCleared"}]
