"""Settings loading: defaults < YAML < environment < command line, and errors that name the flag."""

from __future__ import annotations

import argparse

import pytest

from kvgate.config import ConfigError, Settings, add_settings_arguments, load_settings
from kvgate.scheduler.registry import check_settings


def cli(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return vars(parser.parse_args(argv))


@pytest.fixture
def yaml_file(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "kvgate.yaml"
        path.write_text(text)
        return str(path)

    return write


def test_defaults_keep_llumnix_names_and_values():
    settings = load_settings({}, environ={})
    assert settings == Settings()
    assert (settings.cache_aware_scheduling_min_tokens, settings.kvs_chunk_size, settings.hash_seed) == (
        1024,
        256,
        "0",
    )
    assert settings.kvs_hash_algo == "sha256_cbor" and settings.kvs_iris_meta_prefix == "iris."
    assert settings.effective_policy == "least_load"


def test_each_layer_overrides_the_one_below(yaml_file):
    path = yaml_file("kvs_chunk_size: 64\nkvs_retry_times: 1\nport: 8100\ndispatch_top_k: 2\n")
    environ = {"KVGATE_KVS_RETRY_TIMES": "2", "KVGATE_PORT": "8200"}
    settings = load_settings(cli("--port", "8300"), config_path=path, environ=environ)
    assert settings.kvs_chunk_size == 64  # file over default
    assert settings.kvs_retry_times == 2  # environment over file
    assert settings.port == 8300  # command line over environment
    assert settings.dispatch_top_k == 2 and settings.kvs_backend == "mooncake"


def test_config_flag_reads_the_file_through_the_cli(yaml_file):
    path = yaml_file("dispatch_policy: prefix\n")
    values = cli("--config", path)
    assert load_settings(values, config_path=values["config"], environ={}).dispatch_policy == "prefix"


def test_go_hash_seed_sets_the_seed_and_empty_means_zero():
    assert load_settings({}, environ={"GO_HASH_SEED": "1234"}).hash_seed == "1234"
    assert load_settings({}, environ={"GO_HASH_SEED": ""}).hash_seed == "0"
    assert load_settings({}, environ={"GO_HASH_SEED": "1", "KVGATE_HASH_SEED": "2"}).hash_seed == "2"
    assert load_settings(cli("--hash-seed", "3"), environ={"GO_HASH_SEED": "1"}).hash_seed == "3"


def test_bool_flags_and_lists_from_text():
    assert load_settings(cli("--enable-cache-aware-scheduling"), environ={}).effective_policy == "cache_aware"
    assert not load_settings(
        cli("--enable-cache-aware-scheduling", "false"), environ={}
    ).enable_cache_aware_scheduling
    env = {"KVGATE_DISPATCH_METRIC_ORDER": "num_requests, kv_cache_usage_ratio"}
    assert load_settings({}, environ=env).dispatch_metric_order == ("num_requests", "kv_cache_usage_ratio")


def test_instances_come_from_the_file(yaml_file):
    path = yaml_file(
        "pd_protocol: vllm\n"
        "instances:\n"
        "  - {id: a, url: 'http://127.0.0.1:9001', model: m, kvs_endpoints: ['127.0.0.2']}\n"
        "  - {id: b, url: 'http://127.0.0.1:9002', model: m, role: decode}\n"
        "  - {id: c, url: 'http://127.0.0.1:9003', model: m, role: prefill, bootstrap_port: 8998}\n"
    )
    settings = load_settings({}, config_path=path, environ={})
    assert [(i.id, i.role, i.kvs_endpoints, i.bootstrap_port) for i in settings.instances] == [
        ("a", "neutral", ("127.0.0.2",), None),
        ("b", "decode", (), None),
        ("c", "prefill", (), 8998),
    ]


@pytest.mark.parametrize(
    ("values", "environ", "expected"),
    [
        ({"kvs_chunk_size": "0"}, {}, ["--kvs-chunk-size", "(from command line)", "'0'"]),
        ({}, {"KVGATE_PORT": "http"}, ["--port", "(from environment)", "'http'"]),
        (
            {"dispatch_metric_order": "num_requests,speed"},
            {},
            ["--dispatch-metric-order", "unknown metric", "speed"],
        ),
        ({"dispatch_policy": "fastest"}, {}, ["--dispatch-policy", "'fastest'"]),
        ({"kvs_key_format": "nope"}, {}, ["--kvs-key-format", "unknown key format"]),
        ({"no_such_setting": 1}, {}, ["unknown setting 'no_such_setting'"]),
    ],
)
def test_errors_name_the_flag_the_source_and_the_value(values, environ, expected):
    # What every command runs at start-up: the settings, then the scheduler's names and parameters.
    with pytest.raises(ConfigError) as caught:
        check_settings(load_settings(values, environ=environ))
    message = str(caught.value)
    assert message.startswith("configuration error:")
    for part in expected:
        assert part in message


def test_file_errors(yaml_file, tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings({}, config_path=str(tmp_path / "missing.yaml"), environ={})
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_settings({}, config_path=yaml_file("port: [1,\n"), environ={})
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_settings({}, config_path=yaml_file("- 1\n- 2\n"), environ={})
    with pytest.raises(ConfigError, match=r"--kvs-retry-times \(from file"):
        load_settings({}, config_path=yaml_file("kvs_retry_times: -1\n"), environ={})


def test_instance_errors_point_inside_the_list(yaml_file):
    bad_url = yaml_file("instances:\n  - {id: a, url: 'ftp://x', model: m}\n")
    with pytest.raises(ConfigError, match="instances at 0 -> url"):
        load_settings({}, config_path=bad_url, environ={})
    duplicated = yaml_file(
        "instances:\n  - {id: a, url: 'http://127.0.0.1:1', model: m}\n  - {id: a, url: 'http://127.0.0.1:2', model: m}\n"
    )
    with pytest.raises(ConfigError, match=r"duplicated id\(s\) \['a'\]"):
        load_settings({}, config_path=duplicated, environ={})
