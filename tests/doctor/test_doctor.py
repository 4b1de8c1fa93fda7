"""`kvgate doctor` against mock engines writing into the real Mooncake master: it passes a correct
fleet, and fails naming the cause for a wrong tokenizer, a wrong hash seed and a wrong key format."""

from __future__ import annotations

import asyncio
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from kvgate.commands.doctor import diagnose
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.engine_model import ServiceProfile
from kvgate.gateway.planning.tokenizer import TokenizerService, default_tokenizer_dir, load_tokenizer
from kvgate.mock_engine.publishers import PublisherOptions, open_publisher
from kvgate.mock_engine.server import DEFAULT_MODEL, MockEngineConfig, start_mock_engine
from tests.gateway_helpers import tokenizer

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]

CHUNK = 16


def store_settings(mooncake_master, **changes) -> Settings:
    host, port = mooncake_master.admin_url.removeprefix("http://").split(":")
    return Settings(kvs_backend=KVSBackendName.MOONCAKE, kvs_metadata_service_http_server_host=host,
                    kvs_metadata_service_http_server_port=int(port), kvs_query_budget_ms=2000,
                    kvs_chunk_size=CHUNK, **changes)


class Fleet:
    """Mock engines, each with its own hashing settings and tokenizer, publishing to the real master."""

    def __init__(self, mooncake_master, gateway: Settings) -> None:
        self.master = mooncake_master
        self.gateway = gateway
        self.handles = []
        self.instances: list[InstanceConfig] = []

    async def add(self, engine: Settings, engine_tokenizer=None, report_cached_tokens: bool = True) -> None:
        local_ip = f"127.0.0.{len(self.handles) + 2}"
        publisher = await open_publisher(PublisherOptions(
            "mooncake", engine, local_ip=local_ip, mooncake_master=self.master.rpc_address,
            mooncake_metadata_url=self.master.metadata_url))
        config = MockEngineConfig(time_scale=0.0, settings=engine, report_cached_tokens=report_cached_tokens,
                                  profile=ServiceProfile().with_block_size(engine.kvs_chunk_size))
        handle = await start_mock_engine(config, tokenizer=TokenizerService(engine_tokenizer or tokenizer()),
                                         publisher=publisher)
        self.handles.append(handle)
        self.instances.append(InstanceConfig(id=f"e{len(self.instances)}", url=handle.url, model=DEFAULT_MODEL,
                                             kvs_endpoints=(local_ip,)))

    @property
    def settings(self) -> Settings:
        return self.gateway.model_copy(update={"instances": tuple(self.instances)})

    async def diagnose(self):
        return await diagnose(self.settings, TokenizerService(tokenizer()), timeout_s=10, store_wait_s=2)

    async def close(self) -> None:
        for handle in self.handles:
            await handle.close()


def failures(results) -> dict[tuple[str, str], str]:
    return {(r.check, r.subject): f"{r.detail} | {r.fix}" for r in results if not r.passed}


def other_tokenizer(directory: Path):
    """The default tokenizer with two common words' ids swapped: another vocabulary."""
    source = Path(default_tokenizer_dir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġquick"] = vocab["Ġquick"], vocab["Ġthe"]
    (directory / "tokenizer.json").write_text(json.dumps(spec))
    return load_tokenizer(str(directory))


async def test_a_correct_fleet_passes_every_check_and_the_cli_exits_0(mooncake_master, tmp_path):
    gateway = store_settings(mooncake_master)
    fleet = Fleet(mooncake_master, gateway)
    try:
        await fleet.add(gateway)
        await fleet.add(gateway)
        results = await fleet.diagnose()
        assert failures(results) == {}
        assert {r.check for r in results} == {"mooncake store reachable", "serves the model", "completion tokens",
                                              "chat tokens", "cached tokens reported", "block keys in store",
                                              "engine metrics"}
        assert sum(r.check == "block keys in store" for r in results) == 2

        config = tmp_path / "kvgate.yaml"
        config.write_text(yaml.safe_dump(fleet.settings.model_dump(mode="json", exclude_defaults=True)))
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate.cli", "doctor", "--config", str(config), "--store-wait-s", "2",
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(process.communicate(), 120)
        assert process.returncode == 0, out.decode() + err.decode()
        assert "PASS" in out.decode() and "0 failed" in out.decode()
    finally:
        await fleet.close()


async def one_engine_failures(mooncake_master, gateway: Settings, engine: Settings,
                              **add_options) -> dict[tuple[str, str], str]:
    """The failed checks of a fleet of one engine `engine` behind a gateway configured as `gateway`."""
    fleet = Fleet(mooncake_master, gateway)
    try:
        await fleet.add(engine, **add_options)
        return failures(await fleet.diagnose())
    finally:
        await fleet.close()


async def test_a_wrong_tokenizer_is_named(mooncake_master, tmp_path):
    gateway = store_settings(mooncake_master)
    found = await one_engine_failures(mooncake_master, gateway, gateway, engine_tokenizer=other_tokenizer(tmp_path))
    assert set(found) == {("completion tokens", "e0"), ("chat tokens", "e0")}
    assert "tokenizers differ" in found[("completion tokens", "e0")]


# (gateway settings, engine settings changed from them, Fleet.add options, the failed check, words in its detail)
WRONG_ENGINES = [
    pytest.param({}, {"hash_seed": "12345"}, {}, "block keys in store", ["another seed", "hash_seed"],
                 id="wrong-seed"),
    pytest.param({}, {}, {"report_cached_tokens": False}, "cached tokens reported",
                 ["--enable-prompt-tokens-details"], id="no-cached-tokens"),
    pytest.param({}, {"kvs_key_format": "sglang_mha"}, {}, "block keys in store",
                 ["kvs_key_format='sglang_mha' (config: llumnix)"], id="wrong-key-format"),
    # vLLM's MooncakeStoreConnector keys embed the served model's basename.
    pytest.param({"kvs_key_format": "vllm_mooncake", "kvs_model_name": "org/another-model"},
                 {"kvs_model_name": DEFAULT_MODEL}, {}, "block keys in store",
                 [f"kvs_model_name={DEFAULT_MODEL!r} (config: org/another-model)"], id="wrong-model-name-in-keys"),
]


@pytest.mark.parametrize(("gateway_changes", "engine_changes", "add_options", "check", "named"), WRONG_ENGINES)
async def test_a_wrong_engine_setting_is_named(mooncake_master, gateway_changes, engine_changes, add_options,
                                               check, named):
    gateway = store_settings(mooncake_master, **gateway_changes)
    found = await one_engine_failures(mooncake_master, gateway, gateway.model_copy(update=engine_changes),
                                      **add_options)
    assert set(found) == {(check, "e0")}
    for words in named:
        assert words in found[(check, "e0")]
