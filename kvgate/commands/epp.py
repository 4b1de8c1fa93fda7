"""`kvgate epp`: kvgate as the endpoint picker behind Envoy (Gateway API Inference Extension).

An Envoy ext_proc server (gRPC on --port) that plans each request exactly as `kvgate serve` does and
tells Envoy which engine to send it to; Envoy forwards. Same settings file, flags and KVGATE_*
environment as `kvgate serve`; metrics, health, /debug/schedule and admin routes are served over HTTP
on --http-port. See docs/EPP.md for the Envoy configuration.
"""

from __future__ import annotations

import argparse
import sys

from kvgate.commands.startup import load_settings_and_tokenizer
from kvgate.config.loader import add_settings_arguments
from kvgate.config.settings import Settings


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("epp", help="run the endpoint picker for Envoy (ext_proc)", description=__doc__)
    add_settings_arguments(parser)
    parser.add_argument("--http-port", dest="epp_http_port", default=argparse.SUPPRESS,
                        help="same as --epp-http-port")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    started = load_settings_and_tokenizer(args, "epp", check_picker_settings)
    if started is None:
        return 2
    settings, tokenizer = started
    # Imported after validation: grpc and aiohttp are not needed to reject a config.
    try:
        from kvgate.gateway.ext_proc.server import run_picker
    except ImportError as exc:
        print(f"kvgate epp: {exc.name or exc} is missing: pip install 'kvgate[epp]'", file=sys.stderr)
        return 2

    return run_picker(settings, tokenizer)


def check_picker_settings(settings: Settings) -> None:
    """What the picker cannot do: Envoy sends a request to one engine, so there is no prefill/decode
    hand-off; and it is one process (the load account is its own)."""
    if settings.pd_protocol is not None:
        raise ValueError("--pd-protocol: the endpoint picker does not serve prefill/decode disaggregation "
                         "(Envoy sends each request to one engine); use `kvgate serve`")
    if settings.workers > 1:
        raise ValueError("--workers: the endpoint picker runs as one process")
