"""The events settings as flag, file key and environment variable, and the errors that guard them."""

from __future__ import annotations

import argparse

import pytest

from kvgate.config import ConfigError, add_settings_arguments, load_settings


def cli(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return vars(parser.parse_args(argv))


def test_events_alone_from_every_layer(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text("kvs_backend: kv_events\ninstances:\n"
                    "  - {id: e0, url: 'http://127.0.0.1:8001', model: m,\n"
                    "     kv_events_endpoint: 'tcp://127.0.0.1:5557', kv_events_replay_endpoint: 'tcp://127.0.0.1:5558'}\n")
    settings = load_settings(cli("--kv-events-topic", "kv-events"), config_path=str(path),
                             environ={"KVGATE_KV_EVENTS_MAX_INSTANCES": "128"})
    assert settings.kvs_backend == "kv_events"
    assert (settings.kv_events_topic, settings.kv_events_max_instances) == ("kv-events", 128)
    assert settings.instances[0].kv_events_replay_endpoint == "tcp://127.0.0.1:5558"
    assert load_settings(cli("--kvs-backend", "kv_events"), environ={}).kvs_backend == "kv_events"


@pytest.mark.parametrize("values, message", [
    ({"kvs_backend": "kv_events", "kvs_hash_algo": "xxhash"}, "sha256_cbor"),
    ({"kv_events_format": "sglang"}, "--kv-events-format"),
    ({"instances": [{"id": "e0", "url": "http://127.0.0.1:1", "model": "m", "kv_events_endpoint": "tcp://*:5557"}]},
     "kvgate connects"),
    ({"instances": [{"id": "e0", "url": "http://127.0.0.1:1", "model": "m", "kv_events_endpoint": "127.0.0.1:5557"}]},
     "tcp://HOST:PORT"),
])
def test_inconsistent_events_settings_are_refused(tmp_path, values, message):
    import orjson

    path = tmp_path / "kvgate.json"
    path.write_text(orjson.dumps(values).decode())
    with pytest.raises(ConfigError, match=message):
        load_settings({}, config_path=str(path), environ={})
