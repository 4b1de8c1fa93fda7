"""`kvgate bench overhead`: the latency and request rate the gateway costs on top of its backend.

Setup, all on 127.0.0.1, each in its own process so no two share an event loop:
- an instant backend (kvgate.bench.instant_backend: parses the request, answers at once);
- `kvgate serve` with that backend as its only instance (default settings: least_load policy,
  tokenizer, health checks, stats scraping all on);
- the load generator (closed loop, fixed ~2 KB non-streaming completion), run once straight at
  the backend (the baseline) and once through the gateway, at each concurrency.

Added latency = gateway percentile - direct percentile, measured in the same run. The maximum
request rate is the closed loop's rate at the highest concurrency. Latency on a shared machine
moves with its load; the gateway's CPU time per request (from /proc, over the requests its own
counter saw) does much less, so it is reported too: 1 / (CPU per request) bounds the rate of one core.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from tabulate import tabulate

from kvgate.bench.loadgen import ClosedLoopResult, closed_loop_in_process, in_own_process
from kvgate.bench.routers import instant_backends
from kvgate.kvs_client.launch import LocalProcess, free_port
from kvgate.mock_engine.server import DEFAULT_MODEL

# Below the cache-aware threshold, like the short chat turns that make up most of a gateway's traffic.
PROMPT = ("The gateway reads the request, picks an instance and relays the answer. " * 40)[:2048]
_START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class OverheadConfig:
    concurrency: tuple[int, ...] = (1, 32)
    duration_s: float = 8.0
    max_requests: int = 20000


@dataclass(frozen=True)
class OverheadRow:
    concurrency: int
    direct: ClosedLoopResult
    gateway: ClosedLoopResult
    gateway_cpu_ms_per_request: float | None

    def added_ms(self, percentile: str) -> float | None:
        if self.direct.latency is None or self.gateway.latency is None:
            return None
        return (getattr(self.gateway.latency, percentile) - getattr(self.direct.latency, percentile)) * 1000


def _listening(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=1.0) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


@dataclass(frozen=True)
class GatewayProcess:
    url: str
    pid: int

    def cpu_seconds(self) -> float | None:
        """User + system CPU time of the gateway process (Linux /proc), None elsewhere."""
        try:
            fields = Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        # Fields 14 and 15 of stat(5) (utime, stime), counted after the ")" that ends the command name.
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def requests_answered(self) -> float:
        """The gateway's own count of 200 answers on /v1/completions."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=5.0) as response:
            for family in text_string_to_metric_families(response.read().decode()):
                for sample in family.samples:
                    if (sample.name == "kvgate_requests_total" and sample.labels.get("status") == "200"
                            and sample.labels.get("route") == "/v1/completions"):
                        return sample.value
        return 0.0


@contextlib.contextmanager
def gateway_process(backend_url: str, log_dir: Path) -> Iterator[GatewayProcess]:
    port = free_port()
    config = {
        "host": "127.0.0.1",
        "port": port,
        "kvs_backend": "embedded",  # nothing to ask: the prompt is below the cache-aware threshold
        "instances": [{"id": "backend", "url": backend_url, "model": DEFAULT_MODEL}],
    }
    config_path = log_dir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config_path), "--log-level", "WARNING"]
    process = LocalProcess(argv, log_dir / "gateway.log")
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_ready(lambda: _listening(url), "kvgate serve", _START_TIMEOUT_S)
        yield GatewayProcess(url, process.pid)
    finally:
        process.stop()


def _loop(config: OverheadConfig, base_url: str, concurrency: int) -> ClosedLoopResult:
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": PROMPT, "max_tokens": 1}).encode()
    return in_own_process(closed_loop_in_process, f"{base_url}/v1/completions", body, concurrency,
                          config.duration_s, config.max_requests, timeout_s=config.duration_s + 60.0)


def measure(config: OverheadConfig, log_dir: Path) -> list[OverheadRow]:
    rows = []
    with instant_backends(1, log_dir) as backends, gateway_process(backends[0].url, log_dir) as gateway:
        for concurrency in config.concurrency:
            direct = _loop(config, backends[0].url, concurrency)
            cpu_before, answered_before = gateway.cpu_seconds(), gateway.requests_answered()
            through = _loop(config, gateway.url, concurrency)
            cpu_after, answered = gateway.cpu_seconds(), gateway.requests_answered() - answered_before
            cpu_ms = None
            if cpu_before is not None and cpu_after is not None and answered:
                cpu_ms = (cpu_after - cpu_before) / answered * 1000
            rows.append(OverheadRow(concurrency, direct, through, cpu_ms))
    return rows


def _ms(result: ClosedLoopResult, percentile: str) -> str:
    return f"{getattr(result.latency, percentile) * 1000:.3f}" if result.latency else "-"


def render(rows: Sequence[OverheadRow]) -> str:
    headers = ["concurrency", "direct p50 ms", "direct p99 ms", "gateway p50 ms", "gateway p99 ms",
               "added p50 ms", "added p99 ms", "direct req/s", "gateway req/s", "gateway CPU ms/req", "errors"]
    table = []
    for row in rows:
        added50, added99 = row.added_ms("p50"), row.added_ms("p99")
        errors = sum(row.direct.errors.values()) + sum(row.gateway.errors.values())
        table.append([
            row.concurrency, _ms(row.direct, "p50"), _ms(row.direct, "p99"), _ms(row.gateway, "p50"),
            _ms(row.gateway, "p99"), f"{added50:.3f}" if added50 is not None else "-",
            f"{added99:.3f}" if added99 is not None else "-",
            f"{row.direct.requests_per_s:.0f}", f"{row.gateway.requests_per_s:.0f}",
            f"{row.gateway_cpu_ms_per_request:.3f}" if row.gateway_cpu_ms_per_request is not None else "-", errors,
        ])
    return tabulate(table, headers=headers, tablefmt="github")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("overhead", help="latency and request rate the gateway adds to its backend",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,32", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--duration-s", type=float, default=OverheadConfig.duration_s,
                        help="measured seconds per loop (after a 0.5 s warm-up)")
    parser.add_argument("--max-requests", type=int, default=OverheadConfig.max_requests,
                        help="at most this many measured requests per loop")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--log-dir", default="", help="keep process logs here (default: a temporary directory)")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        concurrency = tuple(int(part) for part in args.concurrency.split(",") if part.strip())
    except ValueError:
        print(f"kvgate bench overhead: --concurrency {args.concurrency!r}: expected integers like 1,32",
              file=sys.stderr)
        return 2
    if not concurrency or min(concurrency) < 1 or args.duration_s <= 0 or args.max_requests < 1:
        print("kvgate bench overhead: --concurrency, --duration-s and --max-requests must be positive",
              file=sys.stderr)
        return 2
    config = OverheadConfig(concurrency, args.duration_s, args.max_requests)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = measure(config, log_dir)
    if args.json:
        print(json.dumps([{"concurrency": r.concurrency, "added_p50_ms": r.added_ms("p50"),
                           "added_p99_ms": r.added_ms("p99"),
                           "gateway_cpu_ms_per_request": r.gateway_cpu_ms_per_request,
                           "direct": _summary(r.direct), "gateway": _summary(r.gateway)} for r in rows], indent=2))
    else:
        print(f"~2 KB non-streaming completion, instant backend, {config.duration_s:g} s per loop "
              f"(at most {config.max_requests} requests), {time.monotonic() - started:.0f} s in all; "
              f"1-minute load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after "
              f"on {os.cpu_count()} CPUs\n")
        print(render(rows))
    return 0


def _summary(result: ClosedLoopResult) -> dict:
    summary = asdict(result)
    summary.pop("latencies_s")
    return summary
