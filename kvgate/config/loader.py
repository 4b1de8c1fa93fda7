"""Build Settings from defaults < YAML file < environment < command-line flags.

The command-line flags are generated from the Settings fields, so a new field is a new flag,
YAML key and environment variable at once. Invalid values raise ConfigError naming the flag,
where it came from and the value, which the CLI prints before exiting.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from kvgate.config.instance_rules import redact_urls_in
from kvgate.config.settings import Settings

ENV_PREFIX = "KVGATE_"
# Engines and Llumnix read the hash seed from this variable; kvgate honours the same one.
SEED_ENV = "GO_HASH_SEED"
_FILE_ONLY_FIELDS = {"instances"}


class ConfigError(ValueError):
    """A configuration value that stops start-up; str() is the operator-facing message."""


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def add_settings_arguments(parser: argparse.ArgumentParser, only: Collection[str] | None = None) -> None:
    """Add one flag per Settings field (or per field in `only`); unset flags stay absent so lower
    layers show through."""
    parser.add_argument("--config", help="YAML file whose keys are the flag names with underscores")
    for name, field in Settings.model_fields.items():
        if name in _FILE_ONLY_FIELDS or (only is not None and name not in only):
            continue
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": name, "help": field.description}
        if field.annotation is bool:
            # `--flag` alone means true; `--flag false` is accepted too, as in Llumnix.
            kwargs.update(nargs="?", const="true", metavar="BOOL")
        parser.add_argument(flag_name(name), **kwargs)


def _read_yaml(path: str) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ConfigError(f"--config {path!r}: cannot read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"--config {path!r}: invalid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"--config {path!r}: expected a mapping of flag names to values")
    return data


def _read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    values: dict[str, Any] = {}
    if environ.get(SEED_ENV) is not None:
        values["hash_seed"] = environ[SEED_ENV]
    for name in Settings.model_fields:
        key = ENV_PREFIX + name.upper()
        if key in environ and name not in _FILE_ONLY_FIELDS:
            values[name] = environ[key]
    return values


def load_settings(
    cli_values: Mapping[str, Any] | None = None,
    config_path: str | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    """Merge the layers and validate once; raises ConfigError with a message naming the flag."""
    environ = os.environ if environ is None else environ
    layers: list[tuple[str, dict[str, Any]]] = []
    if config_path:
        layers.append((f"file {config_path}", _read_yaml(config_path)))
    layers.append(("environment", _read_env(environ)))
    layers.append(("command line", {k: v for k, v in (cli_values or {}).items() if k != "config"}))

    merged: dict[str, Any] = {}
    origin: dict[str, str] = {}
    for source, values in layers:
        for key, value in values.items():
            merged[key] = value
            origin[key] = source
    try:
        return Settings.model_validate(merged)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, origin)) from None


def _describe(exc: ValidationError, origin: Mapping[str, str]) -> str:
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        where = " -> ".join(str(part) for part in error["loc"][1:])
        label = flag_name(field) if field in Settings.model_fields else (field or "settings")
        if error["type"] == "extra_forbidden":
            lines.append(f"unknown setting {field!r} (from {origin.get(field, 'input')})")
            continue
        if not error["loc"]:
            # A check across fields: its input is every setting (secrets included), so only the message.
            lines.append(redact_urls_in(f"invalid settings: {error['msg']}"))
            continue
        value = error.get("input")
        source = origin.get(field, "default")
        detail = f" at {where}" if where else ""
        lines.append(redact_urls_in(f"invalid value for {label}{detail} (from {source}): {value!r}: {error['msg']}"))
    return "configuration error:\n  " + "\n  ".join(lines)
