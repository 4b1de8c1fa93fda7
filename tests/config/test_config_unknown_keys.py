"""An unknown key in the configuration is named where it is, with the closest known name."""

from __future__ import annotations

import pytest

from kvgate.config.loader import ConfigError, load_settings


def error_of(tmp_path, text: str) -> str:
    path = tmp_path / "gateway.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as raised:
        load_settings(config_path=str(path), environ={})
    return str(raised.value)


def test_an_unknown_key_inside_an_instance_names_the_key_the_instance_and_the_likely_one(tmp_path):
    message = error_of(tmp_path, """
instances:
  - {id: a, url: "http://127.0.0.1:8001", model: m}
  - {id: b, url: "http://127.0.0.1:8002", model: m, kvs_endpoint: ["10.0.0.2"]}
  - {url: "http://127.0.0.1:8003", model: m, id: c, rol: prefill, colour: blue}
""")
    assert "unknown key 'kvs_endpoint' in instances[1] (id 'b')" in message
    assert "did you mean 'kvs_endpoints'?" in message
    assert "unknown key 'rol' in instances[2] (id 'c')" in message and "did you mean 'role'?" in message
    assert "unknown key 'colour' in instances[2] (id 'c')" in message
    assert "unknown setting 'instances'" not in message
    assert message.count("unknown key") == 3  # once per key, not per instance


def test_an_unknown_setting_gets_the_closest_name(tmp_path):
    message = error_of(tmp_path, "dispach_policy: cache_aware\nhealth_check_interval: 2\nzzz: 1\n")
    assert "unknown setting 'dispach_policy'" in message and "did you mean 'dispatch_policy'?" in message
    assert "did you mean 'health_check_interval_s'?" in message
    zzz = next(line for line in message.splitlines() if "'zzz'" in line)
    assert "unknown setting 'zzz' (from file" in zzz and "did you mean" not in zzz  # nothing close
