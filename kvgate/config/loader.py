"""Build Settings from defaults < YAML file < environment < command-line flags.

The command-line flags are generated from the Settings fields, so a new field is a new flag,
YAML key and environment variable at once. Invalid values raise ConfigError naming the flag,
where it came from and the value, which the CLI prints before exiting.
"""

from __future__ import annotations

import argparse
import difflib
import os
import typing
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kvgate.config.instance_rules import redact_urls_in
from kvgate.config.settings import Settings

ENV_PREFIX = "KVGATE_"
# Engines and Llumnix read the hash seed from this variable; kvgate honours the same one.
SEED_ENV = "GO_HASH_SEED"
# OpenTelemetry's own variables, honoured as a layer below KVGATE_* (the first one set wins).
OTEL_ENV = {
    "otlp_traces_protocol": ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"),
    "otlp_service_name": ("OTEL_SERVICE_NAME",),
}
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
    for name, variables in OTEL_ENV.items():
        value = next((environ[v] for v in variables if environ.get(v)), None)
        if value is not None:
            values[name] = value
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
        raise ConfigError(_describe(exc, origin, merged)) from None


def _describe(exc: ValidationError, origin: Mapping[str, str], merged: Mapping[str, Any]) -> str:
    lines = []
    for error in exc.errors():
        field = str(error["loc"][0]) if error["loc"] else ""
        where = " -> ".join(str(part) for part in error["loc"][1:])
        label = flag_name(field) if field in Settings.model_fields else (field or "settings")
        if error["type"] == "extra_forbidden":
            lines.append(_unknown_key(error["loc"], origin.get(field, "input"), merged))
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


def _unknown_key(loc: tuple[int | str, ...], source: str, merged: Mapping[str, Any]) -> str:
    """`unknown setting 'x'`, or for a key inside an entry (an instance) the key and the entry by
    index and id; with the closest known name when there is one (`kvs_endpoint` -> `kvs_endpoints`)."""
    key = str(loc[-1])
    if len(loc) == 1:
        text, known = f"unknown setting {key!r}", Settings.model_fields
    else:
        text, known = f"unknown key {key!r} in {_entry_name(loc[:-1], merged)}", _entry_fields(str(loc[0]))
    close = difflib.get_close_matches(key, list(known), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return f"{text} (from {source}){hint}"


def _entry_name(loc: tuple[int | str, ...], merged: Mapping[str, Any]) -> str:
    """`instances[1] (id 'b')` for loc ('instances', 1)."""
    name = str(loc[0]) + "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in loc[1:])
    entry: Any = merged
    for part in loc:
        try:
            entry = entry[part]
        except (KeyError, IndexError, TypeError):
            return name
    entry_id = entry.get("id") if isinstance(entry, Mapping) else None
    return f"{name} (id {entry_id!r})" if isinstance(entry_id, str) else name


def _entry_fields(field: str) -> Collection[str]:
    """The keys an entry of the setting `field` may have (the fields of the model its items are)."""
    info = Settings.model_fields.get(field)
    pending = [info.annotation] if info is not None else []
    while pending:
        annotation = pending.pop()
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            return annotation.model_fields
        pending.extend(typing.get_args(annotation))
    return ()
