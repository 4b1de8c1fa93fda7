"""`kvgate hash` in a real subprocess: golden keys, the seed from the environment, clean errors."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvgate.gateway.planning.tokenizer import default_tokenizer_dir
from kvgate.scheduler.hashing import hash_blocks


def kvgate_hash(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "GO_HASH_SEED"} | (env or {})
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "hash", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=environ,
        check=False,
    )


def keys_of(*args: str, env: dict[str, str] | None = None) -> list[str]:
    result = kvgate_hash(*args, env=env)
    assert result.returncode == 0, result.stderr
    return result.stdout.splitlines()


def test_golden_keys_for_each_algorithm():
    assert keys_of("--tokens", "1,2,3,4,5", "--chunk-size", "4", "--save-unfull-chunk") == [
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb_0",
        "105474563044be49e8741387f67df29d2f9eb696528c310bda92aa1ce554cee6_0",
    ]
    assert keys_of(
        "--algo", "sha256_hex", "--tokens", "1,2,3,4,5", "--chunk-size", "4", "--save-unfull-chunk"
    ) == [
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
        "cb701dbfc2cfd59232c74951be0f3129877ac68f27bee77757d30fb46580a0f2_0",
    ]
    assert keys_of("--algo", "xxhash", "--tokens", "1,2,3,4,5", "--chunk-size", "4") == [
        "iris.block.hash.key.8356527653647720045"
    ]


def test_seed_comes_from_the_environment_unless_given():
    seed_1 = [
        "cd5274edd02cd2be740010d36770ca489dbf581625cf482bce3e1d08c671787b_0",
        "fc72dcda3456ca6a75fbc3fd645c2a40660b0e8c1a21b3c7aa6e4f532116c915_0",
    ]
    args = ("--tokens", "1,2,3,4,5", "--chunk-size", "4", "--save-unfull-chunk")
    assert keys_of(*args, env={"GO_HASH_SEED": "seed-1"}) == seed_1
    assert keys_of(*args, "--seed", "seed-1") == seed_1
    assert keys_of(*args, env={"GO_HASH_SEED": ""})[0].startswith("c9d58ba6")


def test_key_format_and_model_name():
    out = keys_of(
        "--tokens",
        "10,11,12,13",
        "--chunk-size",
        "4",
        "--key-format",
        "vllm_mooncake",
        "--model-name",
        "org/M",
    )
    assert out == [
        "M@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@398c246ffafbdd52fd77aeeb90e6a134c3cfffac128d0a960292db8f8fb2077a"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--tokens", "1,x"), "comma-separated integers"),
        (("--tokens", "1", "--chunk-size", "0"), "at least 1"),
        (("--tokens", "1", "--key-format", "nope"), "unknown key format"),
        (("--tokens", "1,-2", "--chunk-size", "1", "--algo", "sha256_hex"), "out of range"),
        (("--tokens", "1", "--chunk-size", "1", "--key-format", "vllm_mooncake"), "--kvs-model-name"),
        (("--text", "hi", "--tokenizer", "/nonexistent/tokenizer"), "cannot load"),
        ((), "one of the arguments --tokens --text is required"),
    ],
)
def test_bad_input_exits_2_with_a_message(args, message):
    result = kvgate_hash(*args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_text_is_tokenized_as_the_engine_does():
    from transformers import AutoTokenizer

    text = "KV caches are reused when prompts share a prefix. " * 8
    ids = AutoTokenizer.from_pretrained(default_tokenizer_dir()).encode(text)
    expected = [b.value + "_0" for b in hash_blocks("sha256_cbor", ids, 16)]
    assert len(expected) >= 4
    assert keys_of("--text", text, "--chunk-size", "16", "--tokenizer", default_tokenizer_dir()) == expected
    chat = keys_of("--text", text, "--chunk-size", "16", "--chat")
    assert chat and chat != expected
