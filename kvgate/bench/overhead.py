"""`kvgate bench overhead`: the latency and request rate the gateway costs on top of its backend.

Setup, all on 127.0.0.1, each in its own process so no two share an event loop:
- an instant backend (kvgate.bench.instant_backend: parses the request, answers at once);
- `kvgate serve` with that backend as its only instance, once per `--workers` count (default
  1 and 2), on the cache-aware path: cache_aware policy, the ~2 KB (~400-token) prompt above
  `cache_aware_scheduling_min_tokens`, so every request is tokenized, hashed and looked up in the
  embedded index; health checks and stats scraping on;
- sglang-router 0.3.2 with its cache_aware policy in front of the same backend (installed into
  the peers' virtualenv, see peers.py; `--no-peers` skips it);
- with --otlp-traces-endpoint URL, the same gateways again with tracing on, every request sampled and
  its spans exported over OTLP/HTTP to URL (a collector or `python -m tests.otlp_receiver`): what
  tracing costs, beside the same gateways untraced;
- with --floor, a bare relay (kvgate.bench.bare_relay: aiohttp's server and kvgate's upstream
  client, no routing) in front of the same backend: the CPU per request of the HTTP plumbing alone;
- with --epp, Envoy 1.40 (one worker thread) in front of `kvgate epp` with the same settings as
  `kvgate serve` (kvgate.bench.envoy): two hops per request, the ext_proc gRPC stream to the picker
  (headers, body and the answer pass through it) and Envoy's proxy hop to the backend;
- the load generator (closed loop, fixed ~2 KB completion, whole JSON or with --stream an SSE
  stream), run straight at the backend (the baseline) and through each router, at each
  concurrency, interleaved: baseline, then every router, before the next concurrency.

Added latency = router percentile - direct percentile, measured in the same run. The request rate
is the closed loop's rate. "vs peer" is a router's rate over sglang-router cache_aware's in the
same run. Latency on a shared machine moves with its load; a router's CPU time per request does
much less, so it is reported too, for every router, sglang-router included: its processes' CPU
from /proc over the loop, divided by every answer the loop received, warm-up included (the loop
is its only client); for Envoy + kvgate epp, each process's share and their sum. With --runs N the
whole sequence is repeated N times against the same processes and every figure is the median over
the runs (each run's added latency against its own baseline). With --pin the routers run on a
quarter of the CPUs (one of two), the backend and the load generator on the others (CPU affinity,
inherited by every process started meanwhile).
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml
from tabulate import tabulate
from tqdm import tqdm

from kvgate.bench import envoy, peers
from kvgate.bench.loadgen import OVERHEAD_PROMPT, ClosedLoopResult, closed_loop_in_process, in_own_process
from kvgate.bench.routers.processes import Engine, cpu_split, instant_backends, pinned, router
from kvgate.bench.routers.targets import DIRECT, OVERHEAD_CACHE_AWARE_MIN_TOKENS, Target
from kvgate.mock_engine.server import DEFAULT_MODEL
from kvgate.processes import LocalProcess, free_port, process_tree

_START_TIMEOUT_S = 90.0


PEER = Target("sglang-router", "cache_aware")
FLOOR = "bare relay (aiohttp + upstream client)"
EPP = "envoy + kvgate epp cache_aware"


@dataclass(frozen=True)
class OverheadConfig:
    concurrency: tuple[int, ...] = (1, 32)
    duration_s: float = 8.0
    max_requests: int = 20000
    runs: int = 1
    stream: bool = False
    workers: tuple[int, ...] = (1, 2)
    peers: bool = True
    venv_dir: Path | None = None
    install_peers: bool = True
    floor: bool = False  # also measure the bare relay (kvgate.bench.bare_relay)
    epp: bool = False  # also measure Envoy + kvgate epp (kvgate.bench.envoy)
    pin: bool = False  # routers on their own CPUs, the backend and the load generator on the others
    otlp_traces_endpoint: str = ""  # also measure the gateways traced, exporting there


@dataclass(frozen=True)
class MeasuredRouter:
    """A router under test: where clients send, and its processes (name -> pid) whose CPU time it costs."""

    url: str
    processes: dict[str, int]


@dataclass(frozen=True)
class RoutedLoop:
    """One router's loop, and each of its processes' CPU per answered request (empty when /proc
    could not be read)."""

    result: ClosedLoopResult
    cpu_ms_by_process: dict[str, float] = field(default_factory=dict)

    @property
    def cpu_ms_per_request(self) -> float | None:
        return sum(self.cpu_ms_by_process.values()) if self.cpu_ms_by_process else None


@dataclass(frozen=True)
class OverheadRun:
    """One concurrency, one run: the baseline and each router's loop right after it, by label."""

    direct: ClosedLoopResult
    routed: dict[str, RoutedLoop]

    def added_ms(self, label: str, percentile: str) -> float | None:
        loop = self.routed.get(label)
        if loop is None or self.direct.latency is None or loop.result.latency is None:
            return None
        return (getattr(loop.result.latency, percentile) - getattr(self.direct.latency, percentile)) * 1000

    def rate_ratio(self, label: str, reference: str) -> float | None:
        mine, theirs = self.routed.get(label), self.routed.get(reference)
        if mine is None or theirs is None or not theirs.result.requests_per_s:
            return None
        return mine.result.requests_per_s / theirs.result.requests_per_s


@dataclass(frozen=True)
class OverheadRow:
    """One concurrency over every run; figures are medians over the runs."""

    concurrency: int
    runs: tuple[OverheadRun, ...]

    def median(self, figure: Callable[[OverheadRun], float | None]) -> float | None:
        values = [v for v in map(figure, self.runs) if v is not None]
        return statistics.median(values) if values else None

    @property
    def labels(self) -> list[str]:
        return list(dict.fromkeys(label for run in self.runs for label in run.routed))

    def _loop(self, run: OverheadRun, label: str) -> ClosedLoopResult | None:
        if label == DIRECT:
            return run.direct
        routed = run.routed.get(label)
        return routed.result if routed else None

    def added_ms(self, label: str, percentile: str) -> float | None:
        return self.median(lambda run: run.added_ms(label, percentile))

    def latency_ms(self, label: str, percentile: str) -> float | None:
        def read(run: OverheadRun) -> float | None:
            loop = self._loop(run, label)
            return getattr(loop.latency, percentile) * 1000 if loop and loop.latency else None

        return self.median(read)

    def requests_per_s(self, label: str) -> float | None:
        return self.median(lambda run: loop.requests_per_s if (loop := self._loop(run, label)) else None)

    def rate_ratio(self, label: str, reference: str) -> float | None:
        return self.median(lambda run: run.rate_ratio(label, reference))

    def cpu_ms_per_request(self, label: str, process: str | None = None) -> float | None:
        """All of the router's processes together, or the one named `process`."""
        def read(run: OverheadRun) -> float | None:
            loop = run.routed.get(label)
            if loop is None:
                return None
            return loop.cpu_ms_per_request if process is None else loop.cpu_ms_by_process.get(process)

        return self.median(read)

    def processes(self, label: str) -> list[str]:
        return list(dict.fromkeys(name for run in self.runs if (loop := run.routed.get(label))
                                  for name in loop.cpu_ms_by_process))

    def errors(self, label: str) -> int:
        return sum(sum(loop.errors.values()) for run in self.runs if (loop := self._loop(run, label)))


def _listening(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/v1/models", timeout=1.0) as response:
            return response.status == 200
    except (OSError, urllib.error.URLError):
        return False


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of `pid` and its descendants (Linux /proc), None elsewhere."""
    total = 0.0
    for member in process_tree(pid):
        try:
            fields = Path(f"/proc/{member}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            if member == pid:
                return None
            continue
        # Fields 14 and 15 of stat(5) (utime, stime), counted after the ")" that ends the command name.
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def cache_aware_settings(backend_url: str) -> dict:
    """kvgate's settings in front of the backend, for `kvgate serve` and `kvgate epp` alike. The
    cache-aware path: the ~400-token prompt is above the threshold, so each request is tokenized,
    hashed and looked up (in the embedded index, which holds nothing)."""
    return {
        "dispatch_policy": "cache_aware",
        "cache_aware_scheduling_min_tokens": OVERHEAD_CACHE_AWARE_MIN_TOKENS,
        "kvs_backend": "embedded",
        "instances": [{"id": "backend", "url": backend_url, "model": DEFAULT_MODEL}],
    }


@contextlib.contextmanager
def gateway_process(backend_url: str, log_dir: Path, workers: int = 1,
                    traces_endpoint: str = "") -> Iterator[MeasuredRouter]:
    """`kvgate serve` on the cache-aware path; with `traces_endpoint`, tracing every request to it."""
    port = free_port()
    config = {"host": "127.0.0.1", "port": port, "workers": workers, **cache_aware_settings(backend_url)}
    name = f"gateway-w{workers}"
    if traces_endpoint:
        config.update(otlp_traces_endpoint=traces_endpoint, otlp_traces_sample_ratio=1.0)
        name += "-traced"
    config_path = log_dir / f"{name}.yaml"
    config_path.write_text(yaml.safe_dump(config))
    argv = [sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config_path), "--log-level", "WARNING"]
    process = LocalProcess(argv, log_dir / f"{name}.log")
    url = f"http://127.0.0.1:{port}"
    try:
        # With workers, one may listen before the others: wait for the supervisor's line.
        process.wait_ready(lambda: _listening(url) and (workers == 1 or _said_listening(process)),
                           "kvgate serve", _START_TIMEOUT_S)
        yield MeasuredRouter(url, {"kvgate serve": process.pid})
    finally:
        process.stop()


@contextlib.contextmanager
def bare_relay_process(backend_url: str, log_dir: Path) -> Iterator[MeasuredRouter]:
    port = free_port()
    argv = [sys.executable, "-m", "kvgate.bench.bare_relay", "--port", str(port), "--backend", backend_url]
    process = LocalProcess(argv, log_dir / "bare-relay.log")
    url = f"http://127.0.0.1:{port}"
    try:
        process.wait_ready(lambda: _listening(url), "bare relay", _START_TIMEOUT_S)
        yield MeasuredRouter(url, {"bare relay": process.pid})
    finally:
        process.stop()


def _said_listening(process: LocalProcess) -> bool:
    return "kvgate gateway listening on" in process.log_tail()


def _loop(config: OverheadConfig, base_url: str, concurrency: int) -> ClosedLoopResult:
    body = json.dumps({"model": DEFAULT_MODEL, "prompt": OVERHEAD_PROMPT, "max_tokens": 1, "stream": config.stream}).encode()
    return in_own_process(closed_loop_in_process, f"{base_url}/v1/completions", body, concurrency,
                          config.duration_s, config.max_requests, timeout_s=config.duration_s + 60.0)


@contextlib.contextmanager
def epp_pair(backend_url: str, log_dir: Path) -> Iterator[MeasuredRouter]:
    """Envoy in front of `kvgate epp`, with `kvgate serve`'s settings."""
    with envoy.picker_behind_envoy(cache_aware_settings(backend_url), log_dir) as pair:
        yield MeasuredRouter(pair.url, {"envoy": pair.envoy_pid, "kvgate epp": pair.picker_pid})


def _routed_loop(config: OverheadConfig, routed: MeasuredRouter, concurrency: int) -> RoutedLoop:
    """The loop through a router, with each of its processes' CPU time over the answers it sent (the
    loop is its only client)."""
    before = {name: cpu_seconds(pid) for name, pid in routed.processes.items()}
    result = _loop(config, routed.url, concurrency)
    after = {name: cpu_seconds(pid) for name, pid in routed.processes.items()}
    readable = None not in before.values() and None not in after.values()
    if not (readable and result.answers):
        return RoutedLoop(result)
    return RoutedLoop(result, {name: (after[name] - before[name]) / result.answers * 1000 for name in before})


def gateway_label(workers: int, traced: bool = False) -> str:
    return f"kvgate cache_aware --workers {workers}" + (", traced" if traced else "")


def _start_routers(config: OverheadConfig, backends: Sequence[Engine], log_dir: Path,
                   stack: contextlib.ExitStack, log: Callable[[str], None]) -> dict[str, MeasuredRouter]:
    """Every router the config asks for, by label, in front of the backend; those that cannot run
    here are logged and left out."""
    backend_url = backends[0].url
    routers = {gateway_label(n): stack.enter_context(gateway_process(backend_url, log_dir, n))
               for n in config.workers}
    if config.otlp_traces_endpoint:
        routers.update({gateway_label(n, traced=True): stack.enter_context(
            gateway_process(backend_url, log_dir, n, config.otlp_traces_endpoint)) for n in config.workers})
    if config.epp:
        if (reason := envoy.pair_unavailable()) is None:
            routers[EPP] = stack.enter_context(epp_pair(backend_url, log_dir))
        else:
            log(f"{EPP}: unavailable: {reason}")
    if config.floor:
        routers[FLOOR] = stack.enter_context(bare_relay_process(backend_url, log_dir))
    if config.peers:
        env = peers.ensure_peers(config.venv_dir, {PEER.router: peers.PEER_VERSIONS[PEER.router]}, log=log,
                                 install=config.install_peers)
        if PEER.router in env.ready:
            peer = stack.enter_context(router(PEER, backends, env, "", "", log_dir, "overhead"))
            assert peer.pid is not None
            routers[PEER.label] = MeasuredRouter(peer.url, {PEER.router: peer.pid})
        else:
            log(f"{PEER.label}: unavailable: {env.unavailable.get(PEER.router)}")
    return routers


def measure(config: OverheadConfig, log_dir: Path, log: Callable[[str], None] = print) -> list[OverheadRow]:
    runs: dict[int, list[OverheadRun]] = {concurrency: [] for concurrency in config.concurrency}
    split = cpu_split() if config.pin else None
    router_cpus, other_cpus = split or (None, None)
    if split:
        log(f"pinned: routers on CPU(s) {sorted(split[0])}, backend and load generator on {sorted(split[1])}")
    elif config.pin:
        log("not pinned: one CPU, nothing to split")
    with contextlib.ExitStack() as stack:
        # Affinity is inherited: everything started from here on runs on other_cpus unless pinned again.
        stack.enter_context(pinned(other_cpus))
        backends = stack.enter_context(instant_backends(1, log_dir))
        with pinned(router_cpus):
            routers = _start_routers(config, backends, log_dir, stack, log)
        steps = config.runs * len(config.concurrency) * (1 + len(routers))
        with tqdm(total=steps, desc="loops", unit="loop", file=sys.stderr, leave=False) as progress:
            for _ in range(config.runs):
                for concurrency in config.concurrency:
                    direct = _loop(config, backends[0].url, concurrency)
                    progress.update()
                    routed = {}
                    for label, routed_process in routers.items():
                        routed[label] = _routed_loop(config, routed_process, concurrency)
                        progress.update()
                    runs[concurrency].append(OverheadRun(direct, routed))
    return [OverheadRow(concurrency, tuple(results)) for concurrency, results in runs.items()]


def _figure(value: float | None, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if value is not None else "-"


def render(rows: Sequence[OverheadRow]) -> str:
    headers = ["concurrency", "target", "p50 ms", "p99 ms", "added p50 ms", "added p99 ms", "req/s",
               f"req/s vs {PEER.label}", "CPU ms/req", "CPU ms/req by process", "errors"]
    table = []
    for row in rows:
        for label in [DIRECT, *row.labels]:
            routed = label != DIRECT
            table.append([
                row.concurrency, label, _figure(row.latency_ms(label, "p50")), _figure(row.latency_ms(label, "p99")),
                _figure(row.added_ms(label, "p50")) if routed else "(baseline)",
                _figure(row.added_ms(label, "p99")) if routed else "",
                _figure(row.requests_per_s(label), 0),
                _figure(row.rate_ratio(label, PEER.label), 2) if routed else "",
                _figure(row.cpu_ms_per_request(label)) if routed else "", _cpu_split(row, label),
                row.errors(label),
            ])
    return tabulate(table, headers=headers, tablefmt="github")


def _cpu_split(row: OverheadRow, label: str) -> str:
    """A router of several processes, each one's share ("envoy 0.100 + kvgate epp 0.300"); empty for one."""
    names = row.processes(label) if label != DIRECT else []
    if len(names) < 2:
        return ""
    return " + ".join(f"{name} {_figure(row.cpu_ms_per_request(label, name))}" for name in names)


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
    parser.add_argument("--workers", default="1,2", help="comma-separated `kvgate serve --workers` counts (default 1,2)")
    parser.add_argument("--no-peers", action="store_true", help="skip sglang-router cache_aware")
    parser.add_argument("--floor", action="store_true",
                        help="also measure a bare relay (aiohttp's server + kvgate's upstream client, no routing)")
    parser.add_argument("--epp", action="store_true",
                        help=f"also measure Envoy in front of `kvgate epp` (needs kvgate[epp], {envoy.ENVOY_PACKAGE})")
    parser.add_argument("--pin", action="store_true",
                        help="routers on a quarter of the CPUs (at least one), backend and load generator on the rest")
    parser.add_argument("--otlp-traces-endpoint", default="", metavar="URL",
                        help="also measure the gateways with tracing on, exporting every request's spans over "
                        "OTLP/HTTP to URL (e.g. http://127.0.0.1:4318/v1/traces)")
    parser.add_argument("--no-install", action="store_true", help="use the peers' virtualenv as it is")
    parser.add_argument("--venv", type=Path, default=None, help=f"peers' virtualenv (default {peers.default_venv_dir()})")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON instead of a table")
    parser.add_argument("--log-dir", default="", help="keep process logs here (default: a temporary directory)")
    parser.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> OverheadConfig:
    """The run the command line asks for; ValueError says what is wrong with it."""
    try:
        concurrency = tuple(int(part) for part in args.concurrency.split(",") if part.strip())
        workers = tuple(int(part) for part in args.workers.split(",") if part.strip())
    except ValueError:
        raise ValueError("--concurrency and --workers take integers like 1,32") from None
    if (not concurrency or min(concurrency) < 1 or not workers or min(workers) < 1 or args.duration_s <= 0
            or args.max_requests < 1 or args.runs < 1):
        raise ValueError("--concurrency, --workers, --duration-s, --max-requests and --runs must be positive")
    return OverheadConfig(concurrency, args.duration_s, args.max_requests, args.runs, args.stream, workers,
                          peers=not args.no_peers, venv_dir=args.venv, install_peers=not args.no_install,
                          floor=args.floor, epp=args.epp, pin=args.pin,
                          otlp_traces_endpoint=args.otlp_traces_endpoint)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"kvgate bench overhead: {exc}", file=sys.stderr)
        return 2
    started = time.monotonic()
    load_before = os.getloadavg()[0]
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.log_dir) if args.log_dir else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        rows = measure(config, log_dir, log=lambda message: print(message, file=sys.stderr))
    if args.json:
        print(json.dumps([_row_json(row) for row in rows], indent=2))
    else:
        kind = "streamed" if config.stream else "non-streaming"
        print(f"~2 KB {kind} completion on kvgate's cache-aware path, instant backend, {config.duration_s:g} s per loop "
              f"(at most {config.max_requests} requests), {config.runs} run(s), medians; "
              f"{'routers pinned apart from the backend and load generator; ' if config.pin else ''}"
              f"{time.monotonic() - started:.0f} s in all; 1-minute load average {load_before:.1f} before, "
              f"{os.getloadavg()[0]:.1f} after on {os.cpu_count()} CPUs\n")
        print(render(rows))
    return 0


def _row_json(row: OverheadRow) -> dict:
    return {
        "concurrency": row.concurrency,
        "median": {label: {"added_p50_ms": row.added_ms(label, "p50"), "added_p99_ms": row.added_ms(label, "p99"),
                           "requests_per_s": row.requests_per_s(label),
                           "requests_per_s_vs_peer": row.rate_ratio(label, PEER.label),
                           "cpu_ms_per_request": row.cpu_ms_per_request(label),
                           "cpu_ms_per_request_by_process": {name: row.cpu_ms_per_request(label, name)
                                                             for name in row.processes(label)}}
                   for label in row.labels}
        | {DIRECT: {"requests_per_s": row.requests_per_s(DIRECT)}},
        "runs": [{"direct": _summary(run.direct),
                  **{label: {**_summary(loop.result), "cpu_ms_per_request": loop.cpu_ms_per_request,
                             "cpu_ms_per_request_by_process": loop.cpu_ms_by_process}
                     for label, loop in run.routed.items()}} for run in row.runs],
    }


def _summary(result: ClosedLoopResult) -> dict:
    summary = asdict(result)
    summary.pop("latencies_s")
    return summary
