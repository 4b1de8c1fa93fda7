"""Key formats: the golden keys of REFERENCE.md come out of the default preset; presets and templates."""

from __future__ import annotations

import pytest

from kvgate.config import Settings
from kvgate.config.key_formats import check_key_format
from kvgate.config.loader import ConfigError, load_settings
from kvgate.scheduler.hashing import BlockHash, hash_blocks
from kvgate.scheduler.key_formats import make_key_format


def keys(tokens, chunk, save=False, **fields):
    settings = Settings(kvs_chunk_size=chunk, kvs_enable_save_unfull_chunk=save, **fields)
    blocks = hash_blocks(settings.kvs_hash_algo, tokens, chunk, save, settings.hash_seed)
    return make_key_format(settings).keys(blocks)


def test_default_preset_sha256_cbor_golden_keys():
    assert keys([1, 2, 3, 4, 5], 4, save=True) == [
        "c9d58ba695280d69b243e1e0df813136ca9196b286fb1a021e0b2e028ef071cb_0",
        "105474563044be49e8741387f67df29d2f9eb696528c310bda92aa1ce554cee6_0",
    ]
    assert keys([1, 2, 3, 4, 5], 4, save=True, hash_seed="seed-1") == [
        "cd5274edd02cd2be740010d36770ca489dbf581625cf482bce3e1d08c671787b_0",
        "fc72dcda3456ca6a75fbc3fd645c2a40660b0e8c1a21b3c7aa6e4f532116c915_0",
    ]
    assert keys(list(range(32)), 16) == [
        "d830de3d42c00f25a2949b5d12d98642664a44872c1614c5b0147556276afc9c_0",
        "fedd9e4abebebbe6f6cf96b682f08d316063fe2f22a5c552192dd62904fcccac_0",
    ]


def test_default_preset_sha256_hex_suffixes_only_the_partial_block():
    assert keys([1, 2, 3, 4, 5], 4, save=True, kvs_hash_algo="sha256_hex") == [
        "cf97adeedb59e05bfd73a2b4c2a8885708c4f4f70c84c64b27120e72ab733b72",
        "cb701dbfc2cfd59232c74951be0f3129877ac68f27bee77757d30fb46580a0f2_0",
    ]


def test_default_preset_xxhash_uses_the_iris_prefixes():
    assert keys([1, 2, 3, 4, 5], 4, kvs_hash_algo="xxhash") == ["iris.block.hash.key.8356527653647720045"]
    assert keys(
        [1, 2, 3, 4], 4, kvs_hash_algo="xxhash", kvs_iris_meta_prefix="m/", kvs_vllm_block_prefix="b/"
    ) == ["m/b/8356527653647720045"]


BLOCK = BlockHash("ab12", 4, True)


@pytest.mark.parametrize(
    ("key_format", "model", "expected"),
    [
        ("sglang_mha", "", "ab12_0_k"),
        ("sglang_mla", "", "ab12__k"),
        (
            "vllm_mooncake",
            "deepseek-ai/DeepSeek-V3",
            "DeepSeek-V3@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab12",
        ),
        ("vllm_mooncake", "/models/qwen/", "qwen@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab12"),
        ("iris", "", "iris.block.hash.key.ab12"),
        ("kv/{model}/{rank}/{hash}", "org/m", "kv/m/0/ab12"),
        ("{hash}", "", "ab12"),
    ],
)
def test_presets_and_templates(key_format, model, expected):
    settings = Settings(kvs_key_format=key_format, kvs_model_name=model)
    assert make_key_format(settings).keys([BLOCK]) == [expected]


def test_iris_preset_applies_to_any_algorithm():
    settings = Settings(kvs_key_format="iris", kvs_hash_algo="sha256_cbor")
    assert make_key_format(settings).keys([BlockHash("ff", 1, False)]) == ["iris.block.hash.key.ff"]


@pytest.mark.parametrize(
    ("key_format", "message"),
    [
        ("vllm", "unknown key format 'vllm'"),
        ("{model}@x", "template containing {hash}"),
        ("{hash}@{tp}", r"unknown field\(s\) \['tp'\]"),
        ("{hash", "malformed"),
    ],
)
def test_bad_formats_are_rejected_with_a_reason(key_format, message):
    with pytest.raises(ValueError, match=message):
        check_key_format(key_format)
    with pytest.raises(ConfigError, match="--kvs-key-format"):
        load_settings({"kvs_key_format": key_format}, environ={})


def test_model_embedding_format_needs_a_model_name():
    with pytest.raises(ValueError, match="--kvs-model-name"):
        make_key_format(Settings(kvs_key_format="vllm_mooncake"))
