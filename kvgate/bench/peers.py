"""Peer routers for side-by-side benchmarks: install them into a virtualenv of their own, launch them.

The peers (REFERENCE.md section 9) are pinned: sglang-router 0.3.2 and vllm-router 0.1.17, both
wheels on PyPI. They go into a separate virtualenv (default ~/.cache/kvgate/bench-venv) so their
dependencies never meet kvgate's. A peer that cannot be installed is reported with the reason,
never fatal: the benchmark shows it as unavailable.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PEER_VERSIONS = {"sglang-router": "0.3.2", "vllm-router": "0.1.17"}
PEER_POLICIES = ("cache_aware", "round_robin")
_INSTALL_TIMEOUT_S = 600
_PROBE_TIMEOUT_S = 60


def default_venv_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "kvgate" / "bench-venv"


@dataclass
class PeerEnvironment:
    """The peers' virtualenv: which peers are ready, and why the others are not."""

    venv_dir: Path
    ready: dict[str, str] = field(default_factory=dict)  # package -> installed version
    unavailable: dict[str, str] = field(default_factory=dict)  # package -> reason

    @property
    def bin_dir(self) -> Path:
        return self.venv_dir / "bin"

    @property
    def python(self) -> Path:
        return self.bin_dir / "python"


def _installed_version(python: Path, package: str) -> str | None:
    probe = f"import importlib.metadata as m; print(m.version({package!r}))"
    try:
        done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True,
                              timeout=_PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def ensure_peers(venv_dir: Path | None = None, versions: dict[str, str] = PEER_VERSIONS,
                 log=print, install: bool = True) -> PeerEnvironment:
    """Create the virtualenv if needed and pip-install each pinned peer that is missing or differs.

    With `install` false nothing is created or installed: peers not already there are unavailable.
    """
    env = PeerEnvironment(venv_dir or default_venv_dir())
    if not install:
        for package, version in versions.items():
            installed = _installed_version(env.python, package) if env.python.exists() else None
            if installed == version:
                env.ready[package] = installed
            else:
                env.unavailable[package] = f"{package}=={version} not in {env.venv_dir} (--no-install)"
        return env
    try:
        if not env.python.exists():
            log(f"creating the peers' virtualenv in {env.venv_dir}")
            subprocess.run([sys.executable, "-m", "venv", str(env.venv_dir)], check=True,
                           capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        stderr = getattr(exc, "stderr", None) or str(exc)
        for package in versions:
            env.unavailable[package] = f"cannot create virtualenv {env.venv_dir}: {_last_line(stderr)}"
        return env
    for package, version in versions.items():
        if _installed_version(env.python, package) != version:
            log(f"installing {package}=={version} into {env.venv_dir}")
            try:
                done = subprocess.run(
                    [str(env.python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                     f"{package}=={version}"],
                    capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S, check=False,
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                env.unavailable[package] = f"pip install failed: {exc}"
                continue
            if done.returncode != 0:
                env.unavailable[package] = f"pip install failed: {_last_line(done.stderr)}"
                continue
        installed = _installed_version(env.python, package)
        if installed == version:
            env.ready[package] = installed
        else:
            env.unavailable[package] = f"installed version {installed!r}, wanted {version}"
    return env


def sglang_router_command(env: PeerEnvironment, *, port: int, metrics_port: int, worker_urls: Sequence[str],
                          policy: str) -> list[str]:
    """sglang-router with REFERENCE.md section 9's flags; metrics on their own port (default 29000 clashes)."""
    return [
        str(env.python), "-m", "sglang_router.launch_router",
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--cache-threshold", "0.3", "--balance-abs-threshold", "64", "--balance-rel-threshold", "1.5",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "warn",
    ]


def vllm_router_command(env: PeerEnvironment, *, port: int, metrics_port: int, worker_urls: Sequence[str],
                        policy: str) -> list[str]:
    return [
        str(env.bin_dir / "vllm-router"),
        "--host", "127.0.0.1", "--port", str(port),
        "--worker-urls", *worker_urls,
        "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
        "--log-level", "warning",
    ]


PEER_COMMANDS = {"sglang-router": sglang_router_command, "vllm-router": vllm_router_command}
