"""Typed settings, built once from defaults < YAML < environment < CLI."""

from kvgate.config.loader import ConfigError, add_settings_arguments, flag_name, load_settings
from kvgate.config.settings import (
    EarlyRejection,
    HashAlgo,
    InstanceConfig,
    InstanceRole,
    KVSBackendName,
    Settings,
)

__all__ = [
    "ConfigError",
    "EarlyRejection",
    "HashAlgo",
    "InstanceConfig",
    "InstanceRole",
    "KVSBackendName",
    "Settings",
    "add_settings_arguments",
    "flag_name",
    "load_settings",
]
