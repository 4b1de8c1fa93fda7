"""`kvgate doctor --config FILE`: check that a running deployment agrees with the gateway's config.

Prints a pass/fail table with the fix for each failure: every instance reachable and serving its
model; the gateway's token ids for a probe completion and a probe chat equal to the engine's own
(POST /tokenize); the gateway's block keys for a prompt the engine just served present in the store,
at that instance (store, key format, seed, algorithm and chunk size agree); the engine's metrics
parse. Exit status 0 only when every check passes (1 otherwise, 2 for a bad configuration).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from kvgate.config.loader import ConfigError, load_settings
from kvgate.config.settings import Settings

if TYPE_CHECKING:  # imported when used: transformers and aiohttp are not needed to reject a config
    from kvgate.doctor.results import CheckResult
    from kvgate.gateway.planning.tokenizer import TokenizerService


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("doctor", help="check a running deployment against a gateway config",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="the gateway's YAML config (as for kvgate serve)")
    parser.add_argument("--timeout-s", type=float, default=10.0, help="time limit of each engine call")
    parser.add_argument("--store-wait-s", type=float, default=10.0,
                        help="how long to wait for the probe's blocks to appear in the store")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        settings = load_settings({}, config_path=args.config)
    except ConfigError as exc:
        print(f"kvgate doctor: {exc}", file=sys.stderr)
        return 2
    from kvgate.gateway.planning.tokenizer import TokenizerLoadError, TokenizerService, load_tokenizer

    try:
        tokenizer = TokenizerService(load_tokenizer(settings.tokenizer, settings.chat_template))
    except TokenizerLoadError as exc:
        print(f"kvgate doctor: {exc}", file=sys.stderr)
        return 2
    try:
        results = asyncio.run(diagnose(settings, tokenizer, args.timeout_s, args.store_wait_s))
    finally:
        tokenizer.close()
    from kvgate.doctor.results import render

    print(render(results))
    return 0 if all(result.passed for result in results) else 1


async def diagnose(
    settings: Settings, tokenizer: TokenizerService, timeout_s: float, store_wait_s: float
) -> list[CheckResult]:
    """Every check against the deployment `settings` describes."""
    import aiohttp

    from kvgate.config.settings import KVSBackendName
    from kvgate.doctor.checks import Doctor
    from kvgate.kvs_client import make_kvs_client

    kvs = None if settings.kvs_backend == KVSBackendName.KV_EVENTS else make_kvs_client(settings)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            return await Doctor(settings, tokenizer, kvs, session, store_wait_s).run()
    finally:
        if kvs is not None:
            await kvs.close()
