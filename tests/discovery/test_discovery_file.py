"""--discovery file: a real gateway follows an instance list file as it is rewritten, keeps its last
good fleet through a broken file, and lets requests on removed instances finish."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os

import aiohttp
import pytest
import yaml

from kvgate.config import ConfigError, add_settings_arguments, load_settings
from kvgate.config.settings import DiscoveryName
from kvgate.gateway.http.server import GatewayHandle, start_gateway
from kvgate.gateway.state import GATEWAY
from tests.gateway_helpers import (
    assert_nothing_in_flight,
    counter_value,
    gateway_settings,
    read_streamed_completion,
    scripted_upstreams,
    tokenizer,
    wait_until,
)
from tests.scripted_upstream import MODEL, Script


@pytest.fixture
async def engines():
    async with scripted_upstreams("a", "b") as started:
        yield started


def write(path, text: str) -> None:
    """Replace the file at once (a new inode), as editors, kubectl and ConfigMap volumes do."""
    partial = path.with_suffix(".partial")
    partial.write_text(text)
    os.replace(partial, path)


def instances(engines: dict, *names: str) -> list[dict]:
    return [{"id": name, "url": engines[name].url, "model": MODEL} for name in names]


async def start(path, **overrides) -> GatewayHandle:
    settings = gateway_settings({}, MODEL, discovery="file", discovery_file=str(path),
                                discovery_file_poll_interval_s=0.02, dispatch_policy="round_robin", **overrides)
    return await start_gateway(settings, tokenizer=tokenizer())


def fleet(handle: GatewayHandle) -> set[str]:
    return {state.id for state in handle.app[GATEWAY].registry.states()}


async def answered_by(url: str, count: int = 4) -> set[str]:
    names = set()
    async with aiohttp.ClientSession() as session:
        for _ in range(count):
            async with session.post(url + "/v1/completions", json={"model": MODEL, "prompt": "p"}) as response:
                payload = await response.json()
                assert response.status == 200, payload
                names.add(payload["choices"][0]["text"].split("-")[0])
    return names


async def test_the_fleet_follows_the_file(engines, tmp_path):
    path = tmp_path / "fleet.yaml"
    write(path, yaml.safe_dump(instances(engines, "a")))
    handle = await start(path)
    try:
        await wait_until(lambda: fleet(handle) == {"a"})
        assert await answered_by(handle.url) == {"a"}
        write(path, json.dumps({"instances": instances(engines, "a", "b")}))  # JSON, the mapping form
        await wait_until(lambda: fleet(handle) == {"a", "b"})
        assert await answered_by(handle.url) == {"a", "b"}
        write(path, yaml.safe_dump(instances(engines, "b")))
        await wait_until(lambda: fleet(handle) == {"b"})
        assert await answered_by(handle.url) == {"b"}
        assert counter_value(handle, "kvgate_discovery_events_total", source="file", event="reload") == 3
        assert counter_value(handle, "kvgate_discovery_changes_total", change="removed") == 1
        assert counter_value(handle, "kvgate_discovery_instances") == 1
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


@pytest.mark.parametrize("broken, reason", [
    ("- id: a\n  url: [unclosed", "file_invalid"),
    ("- {id: c, url: 'ftp://nowhere', model: m}", "file_invalid"),
    ("- {id: c, url: 'http://127.0.0.1:1', model: m}\n- {id: c, url: 'http://127.0.0.1:2', model: m}",
     "file_invalid"),
    ("just text", "file_invalid"),
    (None, "file_unreadable"),
])
async def test_a_broken_file_keeps_the_last_good_fleet(engines, tmp_path, caplog, broken, reason):
    path = tmp_path / "fleet.yaml"
    write(path, yaml.safe_dump(instances(engines, "a", "b")))
    handle = await start(path)
    try:
        await wait_until(lambda: fleet(handle) == {"a", "b"})
        with caplog.at_level(logging.ERROR, logger="kvgate.discovery.file"):
            if broken is None:
                path.unlink()
            else:
                write(path, broken)
            await wait_until(lambda: counter_value(handle, "kvgate_discovery_errors_total", source="file",
                                                   reason=reason) == 1)
            await asyncio.sleep(0.1)  # later polls of the same broken file: no new error
        assert counter_value(handle, "kvgate_discovery_errors_total", source="file", reason=reason) == 1
        assert "keeping the last good fleet" in caplog.text
        assert counter_value(handle, "kvgate_discovery_source_up", source="file") == 0
        assert fleet(handle) == {"a", "b"}
        assert await answered_by(handle.url) == {"a", "b"}
        write(path, yaml.safe_dump(instances(engines, "a")))  # fixed
        await wait_until(lambda: fleet(handle) == {"a"})
        assert counter_value(handle, "kvgate_discovery_source_up", source="file") == 1
    finally:
        await handle.close()


async def test_a_removed_instance_finishes_its_streams(engines, tmp_path):
    engines["a"].script = Script(chunks=20, delay_s=0.02)
    path = tmp_path / "fleet.yaml"
    write(path, yaml.safe_dump(instances(engines, "a")))
    handle = await start(path)
    try:
        await wait_until(lambda: fleet(handle) == {"a"})
        streaming = asyncio.create_task(read_streamed_completion(handle.url, MODEL))
        await wait_until(lambda: engines["a"].open_streams == 1)
        write(path, yaml.safe_dump(instances(engines, "b")))
        await wait_until(lambda: fleet(handle) == {"b"})
        body = await streaming
        assert b"a-19" in body and body.endswith(b"data: [DONE]\n\n")
        await assert_nothing_in_flight(handle)
    finally:
        await handle.close()


async def test_instances_refused_by_the_fleet_rules_stay_out(engines, tmp_path):
    path = tmp_path / "fleet.yaml"
    outside = {"id": "c", "url": "http://10.1.2.3:8000", "model": MODEL}
    write(path, yaml.safe_dump(instances(engines, "a") + [outside]))
    handle = await start(path, instance_networks="127.0.0.0/8")
    try:
        await wait_until(lambda: counter_value(handle, "kvgate_discovery_errors_total", source="file",
                                               reason="instance_refused") == 1)
        assert fleet(handle) == {"a"}
    finally:
        await handle.close()


def cli(*argv: str) -> dict:
    parser = argparse.ArgumentParser()
    add_settings_arguments(parser)
    return vars(parser.parse_args(argv))


def test_discovery_flags_and_env():
    settings = load_settings(cli("--discovery", "kubernetes", "--discovery-inference-pool", "llama",
                                 "--discovery-namespace", "serving"), environ={})
    assert settings.discovery is DiscoveryName.KUBERNETES and settings.discovery_inference_pool == "llama"
    settings = load_settings([], environ={"KVGATE_DISCOVERY": "file", "KVGATE_DISCOVERY_FILE": "/etc/fleet.yaml"})
    assert settings.discovery is DiscoveryName.FILE and settings.discovery_file == "/etc/fleet.yaml"
    for args, message in ((["--discovery", "file"], "discovery_file"),
                          (["--discovery", "kubernetes"], "discovery_label_selector"),
                          (["--discovery", "kubernetes", "--discovery-label-selector", "a=b",
                            "--discovery-inference-pool", "p"], "one of")):
        with pytest.raises(ConfigError, match=message):
            load_settings(cli(*args), environ={})
