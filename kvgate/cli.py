"""The `kvgate` console script: one subcommand per job, each defined in kvgate.commands.*."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# subcommand -> module with `add_parser(subparsers)`; imported lazily so `kvgate hash` stays fast.
COMMANDS = {
    "serve": "kvgate.commands.serve",
    "epp": "kvgate.commands.epp",
    "hash": "kvgate.commands.hash",
    "mock-engine": "kvgate.commands.mock_engine",
    "demo": "kvgate.commands.demo",
    "simulate": "kvgate.commands.simulate",
    "bench": "kvgate.commands.bench",
    "doctor": "kvgate.commands.doctor",
    "plan": "kvgate.commands.plan",
    "engines": "kvgate.commands.engines",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description="KV-cache-aware gateway for LLM engines")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = argv[0] if argv and argv[0] in COMMANDS else None
    for name, module in COMMANDS.items():
        if wanted and name != wanted:
            # Only the chosen subcommand's module is imported; the others get a stub for --help.
            subparsers.add_parser(name)
            continue
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    # kvgate uses transformers for tokenizers only; its "PyTorch was not found" notice is noise here.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
