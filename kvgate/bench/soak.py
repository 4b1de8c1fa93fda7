"""`kvgate bench soak`: a mixed workload through a real gateway while faults are injected on a schedule.

Processes, all on 127.0.0.1: a `kvgate serve` gateway (cache_aware, Redis store), several
`kvgate mock-engine`s publishing their blocks to a real redis-server, and the client here. The
workload mixes chats and completions, streamed and whole answers, short prompts and long ones
sharing a document prefix (those ask the store). Faults, at fixed fractions of the requests sent:

- an engine is killed (SIGKILL) and later restarted on the same port;
- the KV store (redis-server) is killed and later restarted, empty;
- a poisoned peer: malformed values under the account-sync prefix (the gateway syncs its account
  through the same Redis), a string, wrong shapes, string, negative and huge counts, 2 MB;
- throughout, some clients hang up after the first chunk and some read a chunk every 50 ms;
- throughout, hostile headers: a non-UTF-8 X-Request-Id or Authorization, an 8,000-byte
  X-Request-Id, too many headers (sent on a raw socket, as no well-behaved client would);
- throughout, requests for a second model served only by a lying engine (lying_engine.py):
  negative cached_tokens, and every other stream ending without [DONE].

Outcomes are counted by category. A well-formed request may only fail as a stream cut mid-way by
the engine kill (its bytes were already relayed, so no retry is possible; it ends with an error
event); any other failure is a lost request. A hostile request may be answered or refused with a
4xx; a lying engine's answer may be relayed, ended with an error event, or refused with a 502.
Anything else (a 500, a dropped connection, a stream cut silently) is mishandled. A lost or
mishandled request fails the run, as does any in-flight account entry left at the end. The
gateway's RSS and open files are printed at start, middle and end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson
import yaml
from tabulate import tabulate
from tqdm import tqdm

from kvgate.gateway.fleet.account_sync import KEY_PREFIX
from kvgate.kvs_client.launch import LocalProcess, RedisServerProcess, free_port, start_redis_server
from kvgate.processes import process_tree

MODEL = "kvgate/mock-llm"
LYING_MODEL = "kvgate/lying-llm"  # served by the lying engine alone
_START_TIMEOUT_S = 90.0
_JSON = {"Content-Type": "application/json"}
# A shared document: long prompts are it plus a question, so engines' caches and the store matter.
_DOCUMENT = " ".join(f"clause {i} of the soak agreement binds the parties to term {i * 7 % 101}." for i in range(400))
OK, HUNG_UP, CUT_BY_FAULT = "ok", "hung_up", "cut_by_fault"
WELL_FORMED, HOSTILE, LYING = "well-formed", "hostile headers", "lying engine"
# What each category may end as; anything else is a lost (well-formed) or mishandled request.
ALLOWED = {
    WELL_FORMED: {OK, HUNG_UP, CUT_BY_FAULT},
    HOSTILE: {OK, "http_400", "http_401", "http_403", "http_413", "http_431"},
    LYING: {OK, "stream_error", "http_502"},
}


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 2000
    duration_s: float = 300.0
    concurrency: int = 16
    engines: int = 3
    time_scale: float = 0.05
    max_tokens: int = 24
    hangup_every: int = 23  # every n-th request hangs up after its first chunk
    slow_every: int = 29  # every n-th request reads its stream slowly
    hostile_every: int = 11  # every n-th request carries hostile headers (0: none)
    lying_every: int = 13  # every n-th request asks the lying engine's model (0: none)
    tokenizer: str = ""
    log_dir: Path | None = None


@dataclass
class Fault:
    at_fraction: float
    name: str
    action: Callable[[], None]
    at_s: float | None = None  # when it began, since the start
    done_s: float | None = None  # when it was over (a restarted process answers again)


@dataclass
class Outcome:
    kind: str  # e.g. "chat stream long"
    result: str  # OK, HUNG_UP, CUT_BY_FAULT or an error kind
    started_s: float
    ended_s: float
    category: str = WELL_FORMED


@dataclass
class ProcessSample:
    label: str
    rss_mb: float
    open_files: int


@dataclass
class SoakReport:
    outcomes: list[Outcome] = field(default_factory=list)
    faults: list[Fault] = field(default_factory=list)
    samples: list[ProcessSample] = field(default_factory=list)
    inflight_at_end: float = -1.0
    gateway_counters: dict[str, float] = field(default_factory=dict)
    duration_s: float = 0.0

    @property
    def lost(self) -> list[Outcome]:
        """Well-formed requests that failed other than by a fault's cut."""
        return [o for o in self.outcomes if o.category == WELL_FORMED and o.result not in ALLOWED[WELL_FORMED]]

    @property
    def mishandled(self) -> list[Outcome]:
        """Hostile or lying-engine requests that ended as they may not (a 500, a dropped connection...)."""
        return [o for o in self.outcomes if o.category != WELL_FORMED and o.result not in ALLOWED[o.category]]

    @property
    def passed(self) -> bool:
        return not self.lost and not self.mishandled and self.inflight_at_end == 0 and len(self.outcomes) > 0


# --- processes ------------------------------------------------------------------------------------


def sample_process(pid: int, label: str) -> ProcessSample:
    """RSS and open files of `pid` and its descendants (the supervisor and its workers)."""
    rss_kb = open_files = 0
    for member in process_tree(pid):
        with contextlib.suppress(OSError):  # a worker restarting
            with open(f"/proc/{member}/status") as status:
                rss_kb += next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
            open_files += len(os.listdir(f"/proc/{member}/fd"))
    return ProcessSample(label, rss_kb / 1024, open_files)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/v1/models", timeout=1.0):
            return True
    except OSError:
        return False


class Engine:
    """A mock engine process that can be killed and started again on its port."""

    def __init__(self, index: int, config: SoakConfig, redis_url: str, log_dir: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.endpoint = f"127.0.0.{2 + index}"
        self._argv = [sys.executable, "-m", "kvgate.cli", "mock-engine", "--port", str(self.port), "--model", MODEL,
                      "--time-scale", str(config.time_scale), "--kvs-backend", "redis", "--kvs-redis-url", redis_url,
                      "--kvs-local-ip", self.endpoint]
        if config.tokenizer:
            self._argv += ["--tokenizer", config.tokenizer]
        self._log = log_dir / f"engine-{index}.log"
        self.process = LocalProcess(self._argv, self._log)

    def wait_ready(self) -> None:
        self.process.wait_ready(lambda: _answers(self.url), f"mock engine on {self.url}", _START_TIMEOUT_S)

    def kill(self) -> None:
        self.process.kill()

    def restart(self) -> None:
        self.process.stop()
        self.process = LocalProcess(self._argv, self._log)
        self.wait_ready()


def gateway_config(port: int, engines: list[Engine], redis_url: str, tokenizer: str, liar_url: str) -> dict:
    config = {
        "host": "127.0.0.1", "port": port, "dispatch_policy": "cache_aware", "kvs_backend": "redis",
        "kvs_redis_url": redis_url, "kvs_metadata_service_down_duration_s": 2.0,
        "health_check_interval_s": 0.5, "health_check_failures_to_eject": 2,
        "upstream_first_byte_timeout_s": 10.0, "outlier_consecutive_failures": 3, "outlier_ejection_s": 2.0,
        "account_sync": redis_url, "account_sync_interval_s": 0.1, "account_sync_ttl_s": 1.0,
        "instances": [*({"id": f"engine-{i}", "url": e.url, "model": MODEL, "kvs_endpoints": [e.endpoint]}
                        for i, e in enumerate(engines)),
                      {"id": "liar", "url": liar_url, "model": LYING_MODEL}],
    }
    if tokenizer:
        config["tokenizer"] = tokenizer
    return config


@contextlib.contextmanager
def soak_fleet(config: SoakConfig, log_dir: Path) -> Iterator[tuple[str, int, list[Engine], RedisServerProcess]]:
    """(gateway URL, gateway pid, engines, redis) running until the block ends."""
    with start_redis_server(log_dir) as redis, contextlib.ExitStack() as stack:
        engines = []
        for i in range(config.engines):
            engine = Engine(i, config, redis.url, log_dir)
            stack.callback(lambda e=engine: e.process.stop())
            engines.append(engine)
        liar_url = f"http://127.0.0.1:{free_port()}"
        liar = LocalProcess([sys.executable, "-m", "kvgate.bench.lying_engine", "--port", liar_url.rsplit(":", 1)[1],
                             "--model", LYING_MODEL], log_dir / "lying-engine.log")
        stack.callback(liar.stop)
        for engine in engines:
            engine.wait_ready()
        liar.wait_ready(lambda: _answers(liar_url), "lying engine", _START_TIMEOUT_S)
        port = free_port()
        path = log_dir / "gateway.yaml"
        path.write_text(yaml.safe_dump(gateway_config(port, engines, redis.url, config.tokenizer, liar_url)))
        gateway = LocalProcess([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path),
                                "--log-level", "WARNING"], log_dir / "gateway.log")
        stack.callback(gateway.stop)
        url = f"http://127.0.0.1:{port}"
        gateway.wait_ready(lambda: _answers(url), "kvgate gateway", _START_TIMEOUT_S)
        yield url, gateway.pid, engines, redis


# What the gateway itself counted, printed beside the client's view: (metric, label filter).
_GATEWAY_COUNTERS = {
    "retries to another instance": ("kvgate_forward_retries", {}),
    "outlier ejections": ("kvgate_outlier_ejections", {}),
    "store lookups failed": ("kvgate_kvs_queries", {"outcome": "error"}),
    "store lookups skipped (down)": ("kvgate_kvs_queries", {"outcome": "skipped_down"}),
    "streams broken by an engine": ("kvgate_requests", {"status": "stream_error"}),
    "client hang-ups (499)": ("kvgate_requests", {"status": "499"}),
    "peer values dropped (account sync)": ("kvgate_account_sync_rejected", {}),
    "tokenize cache MB": ("kvgate_tokenize_cache_bytes", {}),
}


def gateway_metric(url: str, name: str, labels: dict[str, str] | None = None) -> float:
    """The sum of `name`'s samples (counters: their _total) whose labels include `labels`."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics", timeout=5.0) as response:
        text = response.read().decode()
    wanted = labels or {}
    return sum(sample.value for family in text_string_to_metric_families(text) if family.name == name
               for sample in family.samples
               if sample.name in (name, name + "_total") and wanted.items() <= sample.labels.items())


def inflight_requests(url: str) -> float:
    return gateway_metric(url, "kvgate_inflight_requests")


# --- the workload ---------------------------------------------------------------------------------


def request_of(index: int, max_tokens: int, model: str = MODEL) -> tuple[str, str, bytes, bool]:
    """(kind, path, body, streamed) of the index-th request: a fixed rotation over the mix."""
    chat, stream, long = index % 2 == 0, index % 4 < 2, index % 5 == 0
    text = f"{_DOCUMENT} Question {index}: which term binds clause {index % 400}?" if long else f"Say hi #{index}."
    body: dict = {"model": model, "max_tokens": max_tokens, "stream": stream}
    if chat:
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = text
    kind = f"{'chat' if chat else 'completion'} {'stream' if stream else 'whole'} {'long' if long else 'short'}"
    return kind, "/v1/chat/completions" if chat else "/v1/completions", orjson.dumps(body), stream


async def _read_stream(response: aiohttp.ClientResponse, slow: bool, hang_up: bool) -> str:
    """The result of a streamed answer read to its end (or hung up on)."""
    done = errored = False
    async for line in response.content:
        if hang_up:
            return HUNG_UP  # leaving the block closes the connection mid-stream
        if slow:
            await asyncio.sleep(0.05)
        if line.startswith(b"data: [DONE]"):
            done = True
        elif line.startswith(b"data:") and b'"error"' in line:
            errored = True
    if errored:
        return "stream_error"
    return OK if done else "truncated"


# Headers no well-behaved client sends; each is sent on its own request, in turn.
HOSTILE_HEADERS: dict[str, list[tuple[bytes, bytes]]] = {
    "non-UTF-8 X-Request-Id": [(b"X-Request-Id", b"req-\xff\xfe\xc3\x28")],
    "non-UTF-8 Authorization": [(b"Authorization", b"Bearer \xff\xfe\xfd")],
    "8000-byte X-Request-Id": [(b"X-Request-Id", b"r" * 8000)],
    "too many headers": [(b"X-Padding-%d" % i, b"v") for i in range(2000)],
}


async def send_hostile(url: str, index: int, config: SoakConfig) -> tuple[str, str]:
    """A well-formed body with hostile headers, on a raw socket (HTTP clients refuse to send these)."""
    name = list(HOSTILE_HEADERS)[index // config.hostile_every % len(HOSTILE_HEADERS)]
    body = orjson.dumps({"model": MODEL, "prompt": f"Say hi #{index}.", "max_tokens": config.max_tokens})
    host, port = url.removeprefix("http://").rsplit(":", 1)
    lines = [b"POST /v1/completions HTTP/1.1", b"Host: " + host.encode(), b"Content-Type: application/json",
             b"Content-Length: %d" % len(body), b"Connection: close"]
    lines += [key + b": " + value for key, value in HOSTILE_HEADERS[name]]
    try:
        async with asyncio.timeout(120):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                writer.write(b"\r\n".join(lines) + b"\r\n\r\n" + body)
                answer = await reader.read()  # to the end: the connection is closed after the answer
            finally:
                writer.close()
    except TimeoutError:
        return name, "timeout"
    except OSError as exc:
        return name, f"client_{type(exc).__name__}"
    status = answer.split(b" ", 2)[1].decode(errors="replace") if answer.startswith(b"HTTP/1.") else "none"
    if status == "200":
        return name, OK if b'"choices"' in answer else "empty_answer"
    return name, f"http_{status}"


async def send_one(session: aiohttp.ClientSession, url: str, index: int, config: SoakConfig) -> tuple[str, str, str]:
    """(category, kind, result) of the index-th request."""
    if config.hostile_every and index % config.hostile_every == config.hostile_every - 1:
        return HOSTILE, *await send_hostile(url, index, config)
    lying = bool(config.lying_every) and index % config.lying_every == config.lying_every - 1
    category = LYING if lying else WELL_FORMED
    hang_up = not lying and index % config.hangup_every == config.hangup_every - 1
    # A hang-up asks for a long answer, so that it really leaves mid-stream.
    kind, path, body, streamed = request_of(index, config.max_tokens * (20 if hang_up else 1),
                                            LYING_MODEL if lying else MODEL)
    hang_up = hang_up and streamed
    slow = streamed and not hang_up and index % config.slow_every == config.slow_every - 1
    kind += " hang-up" if hang_up else " slow-reader" if slow else ""
    try:
        async with asyncio.timeout(120), session.post(url + path, data=body, headers=_JSON) as response:
            if response.status != 200:
                await response.read()
                return category, kind, f"http_{response.status}"
            if not streamed:
                answer = orjson.loads(await response.read())
                return category, kind, OK if answer.get("choices") else "empty_answer"
            return category, kind, await _read_stream(response, slow, hang_up)
    except TimeoutError:
        return category, kind, "timeout"
    except aiohttp.ClientError as exc:
        return category, kind, f"client_{type(exc).__name__}"


async def drive(url: str, gateway_pid: int, faults: list[Fault], config: SoakConfig,
                report: SoakReport) -> None:
    """Send config.requests requests (fewer if config.duration_s runs out) with the faults due."""
    start = time.monotonic()
    deadline = start + config.duration_s
    next_index = 0
    pending = sorted(faults, key=lambda f: f.at_fraction)
    progress = tqdm(total=config.requests, unit="req", desc="soak", leave=False, disable=not sys.stderr.isatty())

    fired: list[asyncio.Task] = []

    async def inject(fault: Fault) -> None:
        fault.at_s = time.monotonic() - start
        await asyncio.to_thread(fault.action)
        fault.done_s = time.monotonic() - start

    def fire_due_faults() -> None:
        # In the background: a restart waits for the process to answer, and the next fault (on
        # another process) must not wait for it.
        while pending and next_index >= pending[0].at_fraction * config.requests:
            fired.append(asyncio.create_task(inject(pending.pop(0))))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def worker() -> None:
            nonlocal next_index
            while next_index < config.requests and time.monotonic() < deadline:
                index = next_index
                next_index += 1
                if index == config.requests // 2:
                    report.samples.append(sample_process(gateway_pid, "middle"))
                started = time.monotonic() - start
                category, kind, result = await send_one(session, url, index, config)
                report.outcomes.append(Outcome(kind, result, started, time.monotonic() - start, category))
                progress.update()

        async def fault_loop() -> None:
            while pending and next_index < config.requests and time.monotonic() < deadline:
                fire_due_faults()
                await asyncio.sleep(0.02)

        await asyncio.gather(fault_loop(), *(worker() for _ in range(config.concurrency)))
        await asyncio.gather(*fired)
        # Faults not reached (time ran out) still run, so restarts always follow kills.
        for fault in pending:
            await inject(fault)
    progress.close()
    report.duration_s = time.monotonic() - start


def attribute_fault_cuts(report: SoakReport, kill_names: tuple[str, ...]) -> None:
    """A stream that broke while an engine was being killed was cut by that fault, not lost."""
    kills = [f.at_s for f in report.faults if f.name in kill_names and f.at_s is not None]
    for outcome in report.outcomes:
        if (outcome.category == WELL_FORMED and outcome.result == "stream_error"
                and any(outcome.started_s <= at <= outcome.ended_s for at in kills)):
            outcome.result = CUT_BY_FAULT


def poison_peers(redis_url: str) -> None:
    """Malformed values under the account-sync prefix, as a broken or hostile replica would write."""
    import redis

    store = redis.Redis.from_url(redis_url, socket_timeout=5)
    try:
        store.mset({KEY_PREFIX + "poison-string": b"hello",
                    KEY_PREFIX + "poison-short-row": orjson.dumps({"engine-0": [1, 2]}),
                    KEY_PREFIX + "poison-string-counts": orjson.dumps({"engine-0": ["1", "0", "0"]}),
                    KEY_PREFIX + "poison-negative": orjson.dumps({"engine-1": [-1_000_000, 0, 0]}),
                    KEY_PREFIX + "poison-float": orjson.dumps({"engine-1": [0.5, 0, 0]}),
                    KEY_PREFIX + "poison-beyond-int64": b'{"engine-1": [9223372036854775808, 0, 0]}',
                    KEY_PREFIX + "poison-2mb": b'{"engine-0": [' + b"1, " * 700_000 + b"0]}"})
        store.rpush(KEY_PREFIX + "poison-list", b"1", b"2", b"3")
    finally:
        store.close()


def run_soak(config: SoakConfig, log_dir: Path) -> SoakReport:
    report = SoakReport()
    with soak_fleet(config, log_dir) as (url, pid, engines, redis):
        victim = engines[0]
        report.faults = [
            Fault(0.15, "engine-0 killed", victim.kill),
            Fault(0.30, "engine-0 restarted", victim.restart),
            Fault(0.45, "KV store killed", redis.kill),
            Fault(0.60, "KV store restarted", redis.restart),
            Fault(0.70, "peer poisoned (account sync)", lambda: poison_peers(redis.url)),
        ]
        report.samples.append(sample_process(pid, "start"))
        asyncio.run(drive(url, pid, report.faults, config, report))
        deadline = time.monotonic() + 10
        while (inflight := inflight_requests(url)) and time.monotonic() < deadline:
            time.sleep(0.1)
        report.inflight_at_end = inflight
        report.gateway_counters = {label: gateway_metric(url, name, labels)
                                   for label, (name, labels) in _GATEWAY_COUNTERS.items()}
        report.gateway_counters["tokenize cache MB"] /= 1024 * 1024
        report.samples.append(sample_process(pid, "end"))
    attribute_fault_cuts(report, ("engine-0 killed",))
    return report


# --- output ---------------------------------------------------------------------------------------


def print_report(report: SoakReport, config: SoakConfig) -> None:
    results = Counter((o.category, o.result) for o in report.outcomes)
    print(tabulate([(c, r, n, "yes" if r in ALLOWED[c] else "NO") for (c, r), n in sorted(results.items())],
                   headers=["category", "result", "requests", "allowed"], tablefmt="github"))
    by_kind = Counter((o.category, o.kind, o.result) for o in report.outcomes if o.result != OK)
    if by_kind:
        print()
        print(tabulate([(c, k, r, n) for (c, k, r), n in sorted(by_kind.items())],
                       headers=["category", "request kind", "result (not ok)", "requests"], tablefmt="github"))
    print()
    print(tabulate([(f.name, f"{f.at_fraction:.0%}", _seconds(f.at_s), _seconds(f.done_s)) for f in report.faults],
                   headers=["fault", "after requests", "began at s", "over at s"], tablefmt="github"))
    print()
    print(tabulate([(label, f"{value:.1f}" if label.endswith("MB") else f"{value:.0f}")
                    for label, value in report.gateway_counters.items()],
                   headers=["gateway counted", "total"], tablefmt="github"))
    print()
    print(tabulate([(s.label, f"{s.rss_mb:.0f}", s.open_files) for s in report.samples],
                   headers=["gateway", "RSS MB", "open files"], tablefmt="github"))
    print(f"\n{len(report.outcomes)} requests in {report.duration_s:.1f} s at concurrency {config.concurrency}, "
          f"{config.engines} mock engines (time scale {config.time_scale}); well-formed requests lost: "
          f"{len(report.lost)}; hostile or lying-engine requests mishandled: {len(report.mishandled)}; "
          f"in flight at the end: {report.inflight_at_end:.0f}")
    print("PASS" if report.passed else "FAIL: requests lost or mishandled, or in-flight entries left (see above)")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def add_parser(subparsers) -> None:
    d = SoakConfig()
    parser = subparsers.add_parser("soak", help="mixed load through the gateway with faults injected on a schedule",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=d.requests, help=f"requests to send (default {d.requests})")
    parser.add_argument("--duration-s", type=float, default=d.duration_s,
                        help=f"stop sending after this long even if requests remain (default {d.duration_s:.0f})")
    parser.add_argument("--concurrency", type=int, default=d.concurrency, help=f"default {d.concurrency}")
    parser.add_argument("--engines", type=int, default=d.engines, help=f"mock engines, at least 2 (default {d.engines})")
    parser.add_argument("--time-scale", type=float, default=d.time_scale,
                        help=f"mock engines' real seconds per modelled GPU second (default {d.time_scale})")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help=f"default {d.max_tokens}")
    parser.add_argument("--tokenizer", default="", help="tokenizer of the gateway and the engines (default: kvgate's)")
    parser.add_argument("--hostile-every", type=int, default=d.hostile_every,
                        help=f"every n-th request carries hostile headers; 0: none (default {d.hostile_every})")
    parser.add_argument("--lying-every", type=int, default=d.lying_every,
                        help=f"every n-th request goes to the lying engine; 0: none (default {d.lying_every})")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every process's log here")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if (args.requests < 10 or args.concurrency < 1 or args.engines < 2 or args.duration_s <= 0
            or args.hostile_every < 0 or args.lying_every < 0):
        print("kvgate bench soak: needs --requests >= 10, --concurrency >= 1, --engines >= 2, --duration-s > 0, "
              "--hostile-every >= 0, --lying-every >= 0", file=sys.stderr)
        return 2
    config = SoakConfig(requests=args.requests, duration_s=args.duration_s, concurrency=args.concurrency,
                        engines=args.engines, time_scale=args.time_scale, max_tokens=args.max_tokens,
                        hostile_every=args.hostile_every, lying_every=args.lying_every,
                        tokenizer=args.tokenizer, log_dir=args.log_dir)
    with contextlib.ExitStack() as stack:
        if config.log_dir:
            config.log_dir.mkdir(parents=True, exist_ok=True)
            log_dir = config.log_dir
        else:
            log_dir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvgate-soak-")))
        report = run_soak(config, log_dir)
    print_report(report, config)
    return 0 if report.passed else 1
