"""Real vLLM engines as fixtures: the engines' virtualenv, the tiny model and its tokenizer.

Every test under tests/vllm/ carries the `vllm` marker. Without the virtualenv they skip with the
install command; with KVGATE_TEST_REQUIRE_VLLM=1 (set by .ci/run) a missing install fails instead, so
CI never passes by skipping them. Each module starts its own engines once (about a minute, up to
several on a fresh or busy machine).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvgate.config.engines import engines_home
from kvgate.engines.install import INSTALL_COMMAND, VLLM_VERSION, EngineVenv, vllm_venv
from kvgate.engines.model import tiny_model
from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer

REQUIRE_ENV = "KVGATE_TEST_REQUIRE_VLLM"


# A module's first test also waits for its engines: on a fresh machine each compiles its model first,
# and three engines sharing two cores have taken over 300 s (the suite's default test timeout).
ENGINE_TEST_TIMEOUT_S = 900


def pytest_collection_modifyitems(items):
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.vllm)
            if item.get_closest_marker("timeout") is None:
                item.add_marker(pytest.mark.timeout(ENGINE_TEST_TIMEOUT_S))


@pytest.fixture(scope="session")
def engine_venv() -> EngineVenv:
    venv = vllm_venv(engines_home())
    if venv.vllm_version() != VLLM_VERSION:
        reason = f"vLLM {VLLM_VERSION} is not installed in {venv.root}: run `{INSTALL_COMMAND}`"
        if os.environ.get(REQUIRE_ENV):
            pytest.fail(reason)
        pytest.skip(reason)
    return venv


@pytest.fixture(scope="session")
def model_dir(engine_venv: EngineVenv) -> Path:
    return tiny_model(engine_venv, engines_home())


@pytest.fixture(scope="session")
def engine_tokenizer(model_dir: Path):
    """kvgate's tokenizer loaded from the engine's own model directory, as `--tokenizer` does."""
    return load_tokenizer(str(model_dir))


@pytest.fixture(scope="session")
def tokenizer_service(engine_tokenizer) -> TokenizerService:
    return TokenizerService(engine_tokenizer)
