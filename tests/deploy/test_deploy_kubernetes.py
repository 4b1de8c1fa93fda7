"""deploy/kubernetes without a cluster: each kustomization rendered by kustomize (kubectl's, or a
standalone binary), every object validated against the Kubernetes schemas (PyPI kubernetes-validate),
custom resources checked against the fields of their published v1 schemas, the objects' references
checked against each other, and every kvgate command line run through kvgate's own parser."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvgate.cli import build_parser, main
from kvgate.config.loader import load_settings
from kvgate.config.settings import Settings
from kvgate.scheduler.registry import check_settings
from tests.deploy.test_compose import _offline, gateway_get_routes

ROOT = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ["base", "overlays/redis", "overlays/epp"]
KUBERNETES_VERSION = "1.30.0"  # the first release whose preStop sleep action is on by default
CONFIG_DIR = "/etc/kvgate"
GATEWAY_ROUTES = {"/health", "/livez", "/metrics"}


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


def _render(name: str) -> list[dict]:
    command = _kustomize_command()
    if command is None:
        pytest.skip("neither kustomize nor kubectl is on PATH")
    rendered = subprocess.run([*command, str(KUSTOMIZE_ROOT / name)], capture_output=True, text=True, timeout=120)
    assert rendered.returncode == 0, rendered.stderr
    return [doc for doc in yaml.safe_load_all(rendered.stdout) if doc]


def _one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name or ''}: {len(found)} found"
    return found[0]


def _gateway(objects: list[dict]) -> dict:
    return _one(objects, "Deployment", "kvgate")


def _container(deployment: dict) -> dict:
    return deployment["spec"]["template"]["spec"]["containers"][0]


def _settings_file(objects: list[dict], deployment: dict, tmp_path: Path) -> Path:
    """The ConfigMap mounted at /etc/kvgate, written out: the settings file the pod reads."""
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in _container(deployment)["volumeMounts"] if m["mountPath"] == CONFIG_DIR)
    config_map = _one(objects, "ConfigMap", volumes[mount["name"]]["configMap"]["name"])
    for key, text in config_map["data"].items():
        (tmp_path / key).write_text(text)
    return tmp_path


def _on_host(argv: list[str], config_dir: Path) -> list[str]:
    return [arg.replace(CONFIG_DIR, str(config_dir)) for arg in argv]


def _kvgate_env(container: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in container.get("env", []) if e["name"].startswith("KVGATE_")}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, _render(request.param)


# --- Kubernetes schemas ---

# Custom resources: the fields of their published v1 CRDs that these manifests use, each object
# checked to hold its required ones and nothing else (a misspelt field fails). Not the full schemas:
# kubernetes-validate ships core kinds only, and the CRDs cannot be fetched offline.
_CUSTOM_FIELDS: dict[tuple[str, str], dict] = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): {
        "required": {"selector", "endpoints"},
        "fields": {"selector", "endpoints", "namespaceSelector", "jobLabel"},
        "endpoints": {"port", "path", "interval", "scheme", "honorLabels", "scrapeTimeout", "bearerTokenSecret"},
    },
    ("inference.networking.k8s.io/v1", "InferencePool"): {
        "required": {"selector", "targetPorts", "endpointPickerRef"},
        "fields": {"selector", "targetPorts", "endpointPickerRef", "appProtocol"},
        "endpointPickerRef": {"group", "kind", "name", "port", "failureMode"},
    },
    ("gateway.networking.k8s.io/v1", "Gateway"): {
        "required": {"gatewayClassName", "listeners"},
        "fields": {"gatewayClassName", "listeners", "addresses", "infrastructure"},
        "listeners": {"name", "hostname", "port", "protocol", "tls", "allowedRoutes"},
    },
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): {
        "required": set(),
        "fields": {"parentRefs", "hostnames", "rules"},
        "rules": {"name", "matches", "filters", "backendRefs", "timeouts", "retry", "sessionPersistence"},
    },
}


def _check_custom(obj: dict) -> None:
    shape = _CUSTOM_FIELDS[(obj["apiVersion"], obj["kind"])]
    spec = obj["spec"]
    where = f"{obj['kind']} {obj['metadata']['name']}"
    assert shape["required"] <= spec.keys(), f"{where} lacks {shape['required'] - spec.keys()}"
    assert spec.keys() <= shape["fields"], f"{where}: unknown {spec.keys() - shape['fields']}"
    for field, allowed in shape.items():
        if field in ("required", "fields") or field not in spec:
            continue
        for item in spec[field] if isinstance(spec[field], list) else [spec[field]]:
            assert item.keys() <= allowed, f"{where}.spec.{field}: unknown {item.keys() - allowed}"


def test_every_object_is_valid_kubernetes(rendered):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    name, objects = rendered
    for obj in objects:
        if (obj["apiVersion"], obj["kind"]) in _CUSTOM_FIELDS:
            _check_custom(obj)
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            raise AssertionError(f"{name}: {obj['kind']} {obj['metadata']['name']}: {exc.message} "
                                 f"at {'.'.join(map(str, exc.path))}") from None


def test_the_schema_check_refuses_a_misspelt_field():
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    service = _one(_render("base"), "Service", "kvgate")
    service["spec"]["port"] = 8000
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(service, KUBERNETES_VERSION, strict=True)
    pool = {"apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool", "metadata": {"name": "p"},
            "spec": {"selector": {"matchLabels": {"app": "x"}}, "targetPortNumber": 8000}}
    with pytest.raises(AssertionError, match="lacks"):
        _check_custom(pool)


# --- the objects agree with each other ---


def test_selectors_ports_and_names_agree(rendered):
    _, objects = rendered
    deployment = _gateway(objects)
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    container_ports = {p["name"]: p["containerPort"] for p in _container(deployment)["ports"]}
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    service = _one(objects, "Service", "kvgate")
    assert service["spec"]["selector"].items() <= labels.items()
    for port in service["spec"]["ports"]:
        assert port["targetPort"] in container_ports
    budget = _one(objects, "PodDisruptionBudget")
    assert budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert budget["spec"]["minAvailable"] < deployment["spec"]["replicas"]
    monitor = _one(objects, "ServiceMonitor")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    [endpoint] = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] in GATEWAY_ROUTES
    # kvgate labels per-engine series `instance`; without honorLabels they become exported_instance.
    assert endpoint["honorLabels"] is True
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        http = _container(deployment)[probe]["httpGet"]
        assert http["port"] in container_ports and http["path"] in GATEWAY_ROUTES, probe
    # Readiness follows the instances; liveness only the process (an engine outage restarts nothing).
    assert _container(deployment)["readinessProbe"]["httpGet"]["path"] == "/health"
    assert _container(deployment)["livenessProbe"]["httpGet"]["path"] == "/livez"


def test_the_routes_the_manifests_probe_are_the_gateway_s():
    """/health, /livez and /metrics as kvgate's application really routes them."""
    assert gateway_get_routes() >= GATEWAY_ROUTES


def test_rbac_lets_the_service_account_read_pods_and_inference_pools(rendered):
    _, objects = rendered
    account = _one(objects, "ServiceAccount")["metadata"]["name"]
    assert _gateway(objects)["spec"]["template"]["spec"]["serviceAccountName"] == account
    binding = _one(objects, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account}]
    role = _one(objects, "Role", binding["roleRef"]["name"])
    granted = {(group, resource): set(rule["verbs"])
               for rule in role["rules"] for group in rule["apiGroups"] for resource in rule["resources"]}
    assert granted == {("", "pods"): {"get", "list", "watch"},
                       ("inference.networking.k8s.io", "inferencepools"): {"get", "list", "watch"}}


def test_shutdown_fits_in_the_termination_grace_period(rendered, tmp_path):
    name, objects = rendered
    deployment = _gateway(objects)
    config_dir = _settings_file(objects, deployment, tmp_path)
    settings = load_settings({}, config_path=str(config_dir / "kvgate.yaml"), environ=_kvgate_env(_container(deployment)))
    pause = _container(deployment)["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > settings.shutdown_grace_s + pause, f"{name}: SIGKILL before the drain ends"


def test_the_init_container_fetches_the_tokenizer_the_settings_name(rendered):
    _, objects = rendered
    pod = _gateway(objects)["spec"]["template"]["spec"]
    [init] = pod["initContainers"]
    assert init["image"] == _container(_gateway(objects))["image"]
    assert f"{CONFIG_DIR}/kvgate.yaml" in init["command"][-1]  # reads the name from the settings file
    cache = {e["name"]: e["value"] for e in init["env"] if "value" in e}["HF_HOME"]
    gateway_env = {e["name"]: e["value"] for e in _container(_gateway(objects))["env"] if "value" in e}
    assert gateway_env["HF_HOME"] == cache
    mounts = lambda c: {m["mountPath"]: m["name"] for m in c["volumeMounts"]}  # noqa: E731
    assert mounts(init)[cache] == mounts(_container(_gateway(objects)))[cache]


# --- kvgate command lines ---


def _check_command_line(objects: list[dict], tmp_path: Path, monkeypatch, capsys) -> Settings:
    deployment = _gateway(objects)
    container = _container(deployment)
    config_dir = _settings_file(objects, deployment, tmp_path)
    for variable, value in _kvgate_env(container).items():
        monkeypatch.setenv(variable, value)
    argv = _on_host(container["args"], config_dir)
    assert argv[0] == "serve"
    args = build_parser(argv).parse_args(argv)
    settings = load_settings({k: v for k, v in vars(args).items() if k in Settings.model_fields},
                             config_path=args.config)
    check_settings(settings)  # policy and metric names, as serve checks them before the tokenizer
    if settings.tokenizer and not _offline(settings.tokenizer):
        # The pod's init container downloads it; here --check-config must refuse, naming it.
        assert main([*argv, "--check-config"]) == 2
        assert repr(settings.tokenizer) in capsys.readouterr().err
    else:
        assert main([*argv, "--check-config"]) == 0
        assert "configuration OK" in capsys.readouterr().out
    assert settings.port == int(next(p for p in container["ports"] if p["name"] == "http")["containerPort"])
    assert settings.host == "0.0.0.0"
    return settings


@pytest.mark.parametrize("name", ["base", "overlays/redis"])
def test_gateway_command_lines_pass_check_config(name, tmp_path, monkeypatch, capsys):
    objects = _render(name)
    settings = _check_command_line(objects, tmp_path, monkeypatch, capsys)
    assert settings.workers >= 2
    assert settings.kvs_backend.value == "kv_events"
    assert all(i.kv_events_endpoint for i in settings.instances)


def test_redis_overlay_syncs_accounts_through_its_redis(tmp_path, monkeypatch, capsys):
    objects = _render("overlays/redis")
    settings = _check_command_line(objects, tmp_path, monkeypatch, capsys)
    service = _one(objects, "Service", "kvgate-redis")
    redis = _one(objects, "Deployment", "kvgate-redis")
    assert service["spec"]["selector"].items() <= redis["spec"]["template"]["metadata"]["labels"].items()
    port = service["spec"]["ports"][0]["port"]
    assert settings.account_sync == f"redis://kvgate-redis:{port}/0"
    assert _gateway(objects)["spec"]["replicas"] > _gateway(_render("base"))["spec"]["replicas"]
    assert _container(redis)["args"][:2] == ["--save", ""]  # nothing persisted: rows expire anyway


def test_epp_overlay_wires_gateway_route_pool_and_picker(tmp_path):
    objects = _render("overlays/epp")
    pool = _one(objects, "InferencePool")
    route = _one(objects, "HTTPRoute")
    gateway = _one(objects, "Gateway")
    picker = _gateway(objects)
    service = _one(objects, "Service", "kvgate")
    [parent] = route["spec"]["parentRefs"]
    assert (parent["kind"], parent["name"]) == ("Gateway", gateway["metadata"]["name"])
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [{"group": "inference.networking.k8s.io", "kind": "InferencePool",
                         "name": pool["metadata"]["name"]}]
    picker_ref = pool["spec"]["endpointPickerRef"]
    assert picker_ref["name"] == service["metadata"]["name"]
    service_ports = {p["port"]: p for p in service["spec"]["ports"]}
    grpc = service_ports[picker_ref["port"]["number"]]
    container_ports = {p["name"]: p["containerPort"] for p in _container(picker)["ports"]}
    args = _container(picker)["args"]
    assert args[0] == "epp"
    flags = dict(arg[2:].split("=", 1) for arg in args[1:])
    assert container_ports[grpc["targetPort"]] == int(flags["port"])
    assert container_ports["http"] == int(flags["http-port"])
    assert flags["config"] == f"{CONFIG_DIR}/kvgate.yaml"


def test_epp_command_line_parses(tmp_path, monkeypatch, capsys):
    objects = _render("overlays/epp")
    container = _container(_gateway(objects))
    config_dir = _settings_file(objects, _gateway(objects), tmp_path)
    argv = _on_host(container["args"], config_dir)
    args = build_parser(argv).parse_args(argv)
    settings = load_settings({k: v for k, v in vars(args).items() if k in Settings.model_fields},
                             config_path=args.config, environ={})
    assert (settings.port, settings.epp_http_port) == (9002, 9090)


def test_every_kustomization_names_files_that_exist():
    for name in KUSTOMIZATIONS:
        kustomization = yaml.safe_load((KUSTOMIZE_ROOT / name / "kustomization.yaml").read_text())
        listed = [*kustomization.get("resources", []),
                  *(p["path"] for p in kustomization.get("patches", [])),
                  *(re.sub(r"^[^=]*=", "", f) for g in kustomization.get("configMapGenerator", [])
                    for f in g.get("files", []))]
        for path in listed:
            assert (KUSTOMIZE_ROOT / name / path).exists(), f"{name} names missing {path}"
