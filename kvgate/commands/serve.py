"""`kvgate serve`: the OpenAI-compatible gateway in front of the configured engine instances.

Instances are listed in the --config YAML file (`instances:`); every other setting is also a flag.
`--check-config` validates everything (settings, tokenizer, chat template), prints a summary and
exits, which is what deployment checks run.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from kvgate.commands.startup import load_settings_and_tokenizer
from kvgate.config.api_keys import load_api_keys
from kvgate.config.instance_rules import redact_url
from kvgate.config.loader import add_settings_arguments
from kvgate.config.pd import check_pd_serving
from kvgate.config.settings import DebugRoutes, KVSBackendName, Settings
from kvgate.scheduler.prefix import names_in_store


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("serve", help="run the gateway", description=__doc__)
    add_settings_arguments(parser)
    parser.add_argument("--check-config", action="store_true",
                        help="validate the configuration and the tokenizer, print a summary, exit")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = load_settings_and_tokenizer(
        args, "serve", lambda settings: check_pd_serving(settings.instances, settings.pd_protocol))
    if started is None:
        return 2
    settings, tokenizer = started
    # The server (aiohttp) and the workers are imported below, after validation: `--check-config` and a
    # rejected config do not need them.
    if args.check_config:
        print(_summary(settings, tokenizer))
        return 0
    if not settings.instances:
        logging.getLogger(__name__).warning("no instances configured: every model is unknown (404) "
                                            "until an instance is added through the admin routes")
    if settings.debug_routes is DebugRoutes.ADMIN and not settings.admin_token:
        logging.getLogger(__name__).warning("--debug-routes admin (the default with --api-keys-file) without "
                                            "--admin-token: /metrics and /debug/schedule answer 404")
    if settings.access_log:
        from kvgate.gateway.http.access_log import configure_logger

        configure_logger()
    from kvgate.workers.supervisor import available_cores, run_workers

    workers = settings.workers or available_cores()
    if workers > 1:
        del tokenizer  # each worker loads its own
        return run_workers(settings, workers, args.log_level)
    from kvgate.gateway.http.server import run_gateway

    return run_gateway(settings, tokenizer)


def _summary(settings: Settings, tokenizer: Any) -> str:
    from kvgate.gateway.planning.tokenizer import describe_tokenizer

    lines = [
        "configuration OK",
        f"  listen:      {settings.host}:{settings.port}",
        f"  policy:      {settings.effective_policy}"
        f" (cache aware from {settings.cache_aware_scheduling_min_tokens} tokens)",
        f"  kv store:    {_kv_store(settings)}",
        f"  tokenizer:   {describe_tokenizer(settings.tokenizer, settings.chat_template, tokenizer)}",
        f"  admin:       {'enabled' if settings.admin_token else 'disabled'}",
        f"  clients:     {_client_access(settings)}; debug routes {settings.debug_routes.value};"
        f" access log {'on' if settings.access_log else 'off'}",
        f"  instance networks: {','.join(settings.instance_networks) or 'any'}",
        f"  workers:     {settings.workers or 'one per available core'}"
        f", account sync {'on' if settings.account_sync else 'off'}",
        f"  instances:   {len(settings.instances)}",
    ]
    for instance in settings.instances:
        endpoints = ",".join(names_in_store(settings, instance)) or "-"
        lines.append(f"    {instance.id}: {redact_url(instance.url)} model={instance.model} role={instance.role.value}"
                     f" kvs_endpoints={endpoints}"
                     + (f" kv_events={instance.kv_events_endpoint}" if instance.kv_events_endpoint else ""))
    if not settings.tokenizer and any(_foreign_model(i.model) for i in settings.instances):
        lines.append("  warning:     no tokenizer is configured but the instances serve other models: unless "
                     "they use the default tokenizer, no prefix hit will ever be found (set tokenizer)")
    return "\n".join(lines)


def _kv_store(settings: Settings) -> str:
    if settings.kvs_backend == KVSBackendName.CONDUCTOR:
        # The indexer hashes token ids itself: kvgate's algorithm, seed and key format play no part.
        model = settings.kvs_conductor_model or "the request's"
        return (f"conductor indexer {settings.kvs_conductor_url}, tenant {settings.kvs_conductor_tenant},"
                f" model {model}, block size {settings.kvs_chunk_size}")
    if settings.kvs_backend == KVSBackendName.KV_EVENTS:
        return (f"none: the engines' KV events (topic {settings.kv_events_topic or 'any'!r}), "
                f"{settings.kvs_hash_algo.value}, block {settings.kvs_chunk_size}, seed {settings.hash_seed!r}")
    return (f"{settings.kvs_backend.value}, {settings.kvs_hash_algo.value}, chunk {settings.kvs_chunk_size},"
            f" keys {settings.kvs_key_format}")


def _foreign_model(model: str) -> bool:
    """A model whose engines surely tokenize otherwise than the default (DeepSeek) tokenizer."""
    return "deepseek" not in model.lower() and model != "kvgate/mock-llm"


def _client_access(settings: Settings) -> str:
    if not settings.api_keys_file:
        return "open (no --api-keys-file)"
    names = [key.name for key in load_api_keys(settings.api_keys_file)]
    return f"{len(names)} API key(s) ({', '.join(names)})"
