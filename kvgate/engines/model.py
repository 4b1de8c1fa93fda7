"""The tiny random-weight model real engines serve in tests, benchmarks and the demo.

Built once per content (the builder script, the tokenizer and the chat template) and cached under the
engines' home; building takes a few seconds in the engines' virtualenv (it needs torch). The tokenizer
and chat template are kvgate's defaults, so `kvgate serve --tokenizer MODEL_DIR` and the engine agree.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvgate.engines import tiny_model_script
from kvgate.engines.install import EnginesMissing, EngineVenv
from kvgate.gateway.planning.tokenizer import DEFAULT_CHAT_TEMPLATE, default_tokenizer_dir

TINY_MODEL_NAME = "kvgate/tiny-llama"
TINY_LORA_NAME = "tiny-lora"  # the adapter built beside the model, as engines serve it (--lora-modules)


def tiny_lora_dir(model_dir: Path) -> Path:
    return model_dir / tiny_model_script.LORA_DIR


def tiny_model(venv: EngineVenv, home: Path) -> Path:
    """The model directory, built on first use; safe against concurrent builders (atomic rename)."""
    script = Path(tiny_model_script.__file__)
    tokenizer_dir = Path(default_tokenizer_dir())
    inputs = [script, tokenizer_dir / "tokenizer.json", tokenizer_dir / "tokenizer_config.json", DEFAULT_CHAT_TEMPLATE]
    digest = hashlib.sha256(b"".join(path.read_bytes() for path in inputs)).hexdigest()[:12]
    target = home / "models" / f"tiny-llama-{digest}"
    if (target / "model.safetensors").exists():
        return target
    venv.require_vllm()
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-llama-", dir=target.parent))
    argv = [str(venv.python), str(script), str(staging), str(tokenizer_dir), str(DEFAULT_CHAT_TEMPLATE)]
    result = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True)
    if result.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise EnginesMissing(f"building the tiny model failed:\n{result.stderr[-4000:]}")
    try:
        staging.rename(target)
    except OSError:  # another builder won the race: its copy is identical
        shutil.rmtree(staging, ignore_errors=True)
    return target
