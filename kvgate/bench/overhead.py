"""`kvgate bench overhead`: the latency and request rate the gateway costs on top of its backend.

Setup, all on 127.0.0.1, each in its own process so no two share an event loop:
- an instant backend (kvgate.bench.instant_backend: parses the request, answers at once);
- `kvgate serve` with that backend as its only instance (default settings: least_load policy,
  tokenizer, health checks, stats scraping all on);
- the load generator (closed loop, fixed ~2 KB completion, whole JSON or with --stream an SSE
  stream), run once straight at the backend (the baseline) and once through the gateway, at each
  concurrency.

Added latency = gateway percentile - direct percentile, measured in the same run. The maximum
request rate is the closed loop's rate at the highest concurrency. Latency on a shared machine
moves with its load; the gateway's CPU time per request (from /proc, over the requests its own
counter saw) does much less, so it is reported too: 1 / (CPU per request) bounds the rate of one core.
With --runs N the whole sequence is repeated N times against the same processes and every figure
is the median over the runs (each run's added latency against its own baseline).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families
from tabulate import tabulate

from kvgate.bench.loadgen import OVERHEAD_PROMPT, ClosedLoopResult, closed_loop_in_process, in_own_process
from kvgate.bench.routers.processes import instant_backends
from kvgate.mock_engine.server import DEFAULT_MODEL
from kvgate.processes import LocalProcess, free_port

_START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class OverheadConfig:
    concurrency: tuple[int, ...] = (1, 32)
    duration_s: float = 8.0
    max_requests: int = 20000
    runs: int = 1
    stream: bool = False


@dataclass(frozen=True)
class OverheadRun:
    """One concurrency, one run: the baseline and the gateway loop right after it."""

    direct: ClosedLoopResult
    gateway: ClosedLoopResult
    gateway_cpu_ms_per_request: float | None

    def added_ms(self, percentile: str) -> float | None:
        if self.direct.latency is None or self.gateway.latency is None:
            return None
        return (getattr(self.gateway.latency, percentile) - getattr(self.direct.latency, percentile)) * 1000


@dataclass(frozen=True)
class OverheadRow:
    """One concurrency over every run; figures are medians over the runs."""

    concurrency: int
    runs: tuple[OverheadRun, ...]

    def median(self, figure: Callable[[OverheadRun], float | None]) -> float | None:
        values = [v for v in map(figure, self.runs) if v is not None]
        return statistics.median(values) if values else None

    def added_ms(self, percentile: str) -> float | None:
        return self.median(lambda run: run.added_ms(percentile))

    def latency_ms(self, side: str, percentile: str) -> float | None:
        def read(run: OverheadRun) -> float | None:
            latency = getattr(run, side).latency
            return getattr(latency, percentile) * 1000 if latency is not None else None

        return self.median(read)

    def requests_per_s(self, side: str) -> float | None:
        return self.median(lambda run: getattr(run, side).requests_per_s)

    @property
    def gateway_cpu_ms_per_request(self) -> float | None:
        return self.median(lambda run: run.gateway_cpu_ms_per_request)

    @property
    def errors(self) -> int:
        return sum(sum(run.direct.errors.values()) + sum(run.gateway.errors.values()) for run in self.runs)


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
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": OVERHEAD_PROMPT, "max_tokens": 1, "stream": config.stream}).encode()
    return in_own_process(closed_loop_in_process, f"{base_url}/v1/completions", body, concurrency,
                          config.duration_s, config.max_requests, timeout_s=config.duration_s + 60.0)


def measure(config: OverheadConfig, log_dir: Path) -> list[OverheadRow]:
    runs: dict[int, list[OverheadRun]] = {concurrency: [] for concurrency in config.concurrency}
    with instant_backends(1, log_dir) as backends, gateway_process(backends[0].url, log_dir) as gateway:
        for _ in range(config.runs):
            for concurrency in config.concurrency:
                direct = _loop(config, backends[0].url, concurrency)
                cpu_before, answered_before = gateway.cpu_seconds(), gateway.requests_answered()
                through = _loop(config, gateway.url, concurrency)
                cpu_after, answered = gateway.cpu_seconds(), gateway.requests_answered() - answered_before
                cpu_ms = None
                if cpu_before is not None and cpu_after is not None and answered:
                    cpu_ms = (cpu_after - cpu_before) / answered * 1000
                runs[concurrency].append(OverheadRun(direct, through, cpu_ms))
    return [OverheadRow(concurrency, tuple(results)) for concurrency, results in runs.items()]


def _figure(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def render(rows: Sequence[OverheadRow]) -> str:
    headers = ["concurrency", "direct p50 ms", "direct p99 ms", "gateway p50 ms", "gateway p99 ms",
               "added p50 ms", "added p99 ms", "direct req/s", "gateway req/s", "gateway CPU ms/req", "errors"]
    table = [
        [row.concurrency, _figure(row.latency_ms("direct", "p50")), _figure(row.latency_ms("direct", "p99")),
         _figure(row.latency_ms("gateway", "p50")), _figure(row.latency_ms("gateway", "p99")),
         _figure(row.added_ms("p50")), _figure(row.added_ms("p99")), _figure(row.requests_per_s("direct"), 0),
         _figure(row.requests_per_s("gateway"), 0), _figure(row.gateway_cpu_ms_per_request), row.errors]
        for row in rows
    ]
    return tabulate(table, headers=headers, tablefmt="github")


def add_parser(subparsers) -> None:
    parser = subparsers.add_parser("overhead", help="latency and request rate the gateway adds to its backend",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,32", help="comma-separated closed-loop concurrencies")
    parser.add_argument("--duration-s", type=float, default=OverheadConfig.duration_s,
                        help="measured seconds per loop (after a 0.5 s warm-up)")
    parser.add_argument("--max-requests", type=int, default=OverheadConfig.max_requests,
                        help="at most this many measured requests per loop")
    parser.add_argument("--runs", type=int, default=OverheadConfig.runs,
                        help="repeat every loop this many times and print medians (a shared machine's load moves)")
    parser.add_argument("--stream", action="store_true", help="streamed (SSE) completions instead of whole JSON")
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
    if not concurrency or min(concurrency) < 1 or args.duration_s <= 0 or args.max_requests < 1 or args.runs < 1:
        print("kvgate bench overhead: --concurrency, --duration-s, --max-requests and --runs must be positive",
              file=sys.stderr)
        return 2
    config = OverheadConfig(concurrency, args.duration_s, args.max_requests, args.runs, args.stream)
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = measure(config, log_dir)
    if args.json:
        print(json.dumps([_row_json(row) for row in rows], indent=2))
    else:
        kind = "streamed" if config.stream else "non-streaming"
        print(f"~2 KB {kind} completion, instant backend, {config.duration_s:g} s per loop "
              f"(at most {config.max_requests} requests), {config.runs} run(s), medians; "
              f"{time.monotonic() - started:.0f} s in all; 1-minute load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs\n")
        print(render(rows))
    return 0


def _row_json(row: OverheadRow) -> dict:
    return {
        "concurrency": row.concurrency,
        "median": {"added_p50_ms": row.added_ms("p50"), "added_p99_ms": row.added_ms("p99"),
                   "direct_requests_per_s": row.requests_per_s("direct"),
                   "gateway_requests_per_s": row.requests_per_s("gateway"),
                   "gateway_cpu_ms_per_request": row.gateway_cpu_ms_per_request},
        "runs": [{"added_p50_ms": run.added_ms("p50"), "added_p99_ms": run.added_ms("p99"),
                  "gateway_cpu_ms_per_request": run.gateway_cpu_ms_per_request,
                  "direct": _summary(run.direct), "gateway": _summary(run.gateway)} for run in row.runs],
    }


def _summary(result: ClosedLoopResult) -> dict:
    summary = asdict(result)
    summary.pop("latencies_s")
    return summary
