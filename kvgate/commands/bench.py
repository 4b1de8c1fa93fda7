"""`kvgate bench <name>`: benchmarks that print figures, the baseline measured in the same run."""

from __future__ import annotations

import importlib

# benchmark -> module with `add_parser(subparsers)`.
BENCHMARKS = {
    "account-sync": "kvgate.bench.account_sync",
    "decision": "kvgate.bench.decision",
    "hot-path": "kvgate.bench.hot_path",
    "kvs": "kvgate.bench.kvs_query",
    "overhead": "kvgate.bench.overhead",
    "replay": "kvgate.bench.replay",
    "routers": "kvgate.bench.routers",
    "soak": "kvgate.bench.soak",
}


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("bench", help="run a benchmark and print its figures")
    bench_subparsers = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    for module in BENCHMARKS.values():
        importlib.import_module(module).add_parser(bench_subparsers)
