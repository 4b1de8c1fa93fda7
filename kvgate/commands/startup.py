"""The start-up shared by the commands that run the gateway (`kvgate serve`, `kvgate epp`): settings
loaded and checked, then the tokenizer, each error answered on stderr before anything heavy is imported."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

from kvgate.config.loader import ConfigError, load_settings
from kvgate.config.settings import Settings
from kvgate.gateway.tracing import check_tracing
from kvgate.scheduler.registry import check_settings


def load_settings_and_tokenizer(args: argparse.Namespace, command: str,
                                check_command: Callable[[Settings], None]) -> tuple[Settings, Any] | None:
    """Logging configured, the settings (flags, file, KVGATE_* environment) loaded and checked, with
    `check_command` for what only this command refuses, then the tokenizer loaded. None after printing
    `kvgate <command>: <error>` on stderr: the caller exits 2."""
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli_values = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        settings = load_settings(cli_values, config_path=args.config)
        check_settings(settings)
        check_command(settings)
        check_tracing(settings)
    except (ConfigError, ValueError) as exc:
        print(f"kvgate {command}: {exc}", file=sys.stderr)
        return None
    # Imported after validation: transformers (and the server's aiohttp or grpc, imported by the caller
    # after this) are not needed to reject a config.
    from kvgate.gateway.planning.tokenizer import TokenizerLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(settings.tokenizer, settings.chat_template)
    except TokenizerLoadError as exc:
        print(f"kvgate {command}: {exc}", file=sys.stderr)
        return None
    return settings, tokenizer
