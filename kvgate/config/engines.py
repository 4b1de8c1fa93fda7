"""Where kvgate keeps real engines' virtualenvs and models: `KVGATE_ENGINES_HOME`, else ~/.cache/kvgate/engines."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

ENGINES_HOME_ENV = "KVGATE_ENGINES_HOME"


def engines_home(environ: Mapping[str, str] | None = None) -> Path:
    environ = os.environ if environ is None else environ
    configured = environ.get(ENGINES_HOME_ENV, "")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "kvgate" / "engines"
