"""One rule for instance ids and URLs (admin routes and the config file alike), the optional
--instance-networks allow-list, and credentials in instance URLs never shown."""

from __future__ import annotations

import logging

import aiohttp
import pytest

from kvgate.config.loader import ConfigError, load_settings
from kvgate.gateway.http.server import start_gateway
from tests.gateway_helpers import gateway_settings, tokenizer
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

TOKEN = "s3cret-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}

BAD_IDS = ["{x}", "a{b}", "a" * 8200, "", "-lead", "a/b", "a b", "caf\u00e9", "a%2Fb"]
BAD_URLS = [
    "http://127.0.0.1:99999/", "http://:19599/", "http://127.0.0.1:0/", "http://127.0.0.1:80 80/",
    "http://127.0.0.1:8000/a b", "ftp://127.0.0.1/", "127.0.0.1:8000", "http://", "http://127.0.0.1:x/",
    "http://127.0.0.1:8000/?debug=1", "http://127.0.0.1:8000\n/",
]


@pytest.fixture
async def upstream():
    started = await ScriptedUpstream("a", Script()).start()
    yield started
    await started.close()


async def admin(session: aiohttp.ClientSession, url: str, method: str, path: str, json=None) -> tuple[int, dict]:
    async with session.request(method, url + path, json=json, headers=ADMIN) as response:
        return response.status, await response.json()


async def test_bad_ids_and_urls_are_refused_with_400(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, admin_token=TOKEN),
                                 tokenizer=tokenizer())
    try:
        async with aiohttp.ClientSession() as session:
            for bad_id in BAD_IDS:
                status, payload = await admin(session, handle.url, "POST", "/admin/instances",
                                              {"id": bad_id, "url": upstream.url, "model": MODEL})
                assert status == 400 and payload["error"]["param"] == "id", bad_id[:20]
            for bad_url in BAD_URLS:
                status, payload = await admin(session, handle.url, "POST", "/admin/instances",
                                              {"id": "b", "url": bad_url, "model": MODEL})
                assert status == 400 and payload["error"]["param"] == "url", bad_url
                assert payload["error"]["type"] == "invalid_request_error"
            # The longest id allowed can be added, drained and removed by name.
            longest = "i" * 128
            assert (await admin(session, handle.url, "POST", "/admin/instances",
                                {"id": longest, "url": upstream.url, "model": MODEL}))[0] == 201
            assert (await admin(session, handle.url, "POST", f"/admin/instances/{longest}/drain"))[0] == 200
            assert (await admin(session, handle.url, "DELETE", f"/admin/instances/{longest}"))[0] == 200
            status, listing = await admin(session, handle.url, "GET", "/admin/instances")
            assert status == 200 and [i["id"] for i in listing["instances"]] == ["a"]
    finally:
        await handle.close()


async def test_credentials_in_urls_are_never_shown(upstream, caplog):
    port = upstream.url.rsplit(":", 1)[1]
    with_credentials = f"http://operator:hunter2@127.0.0.1:{port}"
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, admin_token=TOKEN),
                                 tokenizer=tokenizer())
    try:
        with caplog.at_level(logging.DEBUG):
            async with aiohttp.ClientSession() as session:
                status, added = await admin(session, handle.url, "POST", "/admin/instances",
                                            {"id": "b", "url": with_credentials, "model": MODEL})
                assert status == 201 and added["url"] == f"http://***@127.0.0.1:{port}"
                status, listing = await admin(session, handle.url, "GET", "/admin/instances")
                assert "hunter2" not in str(listing) and "operator" not in str(listing)
                async with session.post(handle.url + "/debug/schedule", json={"model": MODEL, "prompt": "x"}) as r:
                    assert r.status == 200 and "hunter2" not in await r.text()
                # Listed: and the engine behind it still answers.
                for _ in range(2):
                    async with session.post(handle.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                        assert r.status == 200
        assert "hunter2" not in caplog.text
    finally:
        await handle.close()


async def test_instance_networks_allow_list_at_run_time(upstream):
    handle = await start_gateway(gateway_settings({"a": upstream.url}, MODEL, admin_token=TOKEN,
                                                  instance_networks="127.0.0.0/24,10.0.0.0/8"), tokenizer=tokenizer())
    try:
        async with aiohttp.ClientSession() as session:
            for refused in ("http://169.254.169.254/", "http://127.0.1.1:8000", "http://[::1]:8000",
                            "http://localhost:8000", "http://metadata.internal/"):
                status, payload = await admin(session, handle.url, "POST", "/admin/instances",
                                              {"id": "b", "url": refused, "model": MODEL})
                assert status == 400 and payload["error"]["code"] == "instance_network_refused", refused
            status, _ = await admin(session, handle.url, "POST", "/admin/instances",
                                    {"id": "b", "url": "http://127.0.0.9:8000", "model": MODEL})
            assert status == 201
    finally:
        await handle.close()


def _config(tmp_path, url: str, instance_id: str = "e0", networks: str | None = None) -> str:
    path = tmp_path / "gateway.yaml"
    lines = [f"instance_networks: {networks!r}"] if networks else []
    lines += ["instances:", f"  - id: {instance_id!r}", f"    url: {url!r}", "    model: m"]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_the_config_file_follows_the_same_rules(tmp_path):
    for bad_url in BAD_URLS[:5]:
        with pytest.raises(ConfigError, match="--instances"):
            load_settings(config_path=_config(tmp_path, bad_url), environ={})
    with pytest.raises(ConfigError, match="instance id"):
        load_settings(config_path=_config(tmp_path, "http://127.0.0.1:8000", instance_id="{x}"), environ={})
    with pytest.raises(ConfigError, match="outside the networks") as outside:
        load_settings({"admin_token": "admin-secret"},
                      config_path=_config(tmp_path, "http://op:hunter2@169.254.169.254", networks="10.0.0.0/8"),
                      environ={})
    assert "hunter2" not in str(outside.value) and "admin-secret" not in str(outside.value)
    with pytest.raises(ConfigError, match="port") as bad_port:
        load_settings(config_path=_config(tmp_path, "http://op:hunter2@127.0.0.1:99999"), environ={})
    assert "hunter2" not in str(bad_port.value)
    with pytest.raises(ConfigError, match="is a name"):
        load_settings(config_path=_config(tmp_path, "http://engine-1:8000", networks="10.0.0.0/8"), environ={})
    with pytest.raises(ConfigError, match="--instance-networks"):
        load_settings({"instance_networks": "10.0.0.0/33"}, environ={})
    settings = load_settings(config_path=_config(tmp_path, "http://10.1.2.3:8000", networks="10.0.0.0/8"),
                             environ={})
    assert settings.instances[0].url == "http://10.1.2.3:8000" and settings.instance_networks == ("10.0.0.0/8",)
