"""Start real metadata services on loopback for tests, benchmarks and demos.

`start_mooncake_master()` and `start_redis_server()` run the real binaries on free loopback
ports, wait until they answer, and stop them on exit (context managers). Their output goes to
a log file whose tail is put in every start-up error, because "did not become ready" alone
tells an operator nothing.

Free ports are picked by binding port 0 and releasing it; another process may grab the port
in between, so a start that fails is retried on fresh ports a few times. Children die with
their parent (kvgate.processes.die_with_parent), so a killed test run or benchmark leaves no
servers behind. The binaries are looked for on PATH and beside the running Python's scripts.
"""

from __future__ import annotations

import contextlib
import socket
import tempfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvgate.processes import (
    LOOPBACK,
    LocalProcess,
    ServiceStartError,
    find_program,
    free_port,
    tcp_accepts,
)

_START_ATTEMPTS = 3


def _http_json_ok(url: str, predicate: Callable[[bytes], bool]) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=0.5) as response:
            return response.status == 200 and predicate(response.read())
    except (OSError, urllib.error.URLError):
        return False


@dataclass
class MooncakeMasterProcess:
    """A running `mooncake_master`; the three addresses are what clients and kvgate need."""

    host: str
    rpc_port: int
    metadata_port: int
    admin_port: int
    process: LocalProcess

    @property
    def admin_url(self) -> str:
        """Admin/metrics HTTP server: /health, /metrics, /batch_query_keys."""
        return f"http://{self.host}:{self.admin_port}"

    @property
    def rpc_address(self) -> str:
        """Master RPC endpoint for store clients."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        """HTTP metadata server for the transfer engines of store clients."""
        return f"http://{self.host}:{self.metadata_port}/metadata"

    def healthy(self) -> bool:
        return _http_json_ok(f"{self.admin_url}/health", lambda body: b'"service_ready":true' in body)

    def kill(self) -> None:
        self.process.kill()

    def stop(self) -> None:
        self.process.stop()


def mooncake_master_binary() -> str | None:
    return find_program("mooncake_master")


def _launch_mooncake_master(log_dir: Path, host: str, extra_args: list[str], timeout_s: float) -> MooncakeMasterProcess:
    binary = mooncake_master_binary()
    if binary is None:
        raise ServiceStartError("mooncake_master not found on PATH (pip install mooncake-transfer-engine-non-cuda)")
    rpc_port, metadata_port, admin_port = free_port(host), free_port(host), free_port(host)
    argv = [
        binary,
        f"--rpc_address={host}",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=true",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={metadata_port}",
        f"--metrics_host={host}",
        f"--metrics_port={admin_port}",
        *extra_args,
    ]
    log_path = log_dir / f"mooncake_master-{admin_port}.log"
    master = MooncakeMasterProcess(host, rpc_port, metadata_port, admin_port, LocalProcess(argv, log_path))

    def ready() -> bool:
        # /health turns ready before the other listeners are guaranteed up; clients need all three.
        return master.healthy() and tcp_accepts(host, rpc_port) and tcp_accepts(host, metadata_port)

    try:
        master.process.wait_ready(ready, "mooncake_master", timeout_s)
    except BaseException:
        master.stop()
        raise
    return master


def _with_retries(launch: Callable[[], object]):
    last_error: ServiceStartError | None = None
    for _ in range(_START_ATTEMPTS):
        try:
            return launch()
        except ServiceStartError as exc:
            if "not found on PATH" in str(exc):
                raise
            last_error = exc
    assert last_error is not None
    raise last_error


@contextlib.contextmanager
def _log_dir(log_dir: Path | None) -> Iterator[Path]:
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        yield log_dir
        return
    with tempfile.TemporaryDirectory(prefix="kvgate-services-") as tmp:
        yield Path(tmp)


@contextlib.contextmanager
def start_mooncake_master(
    log_dir: Path | None = None,
    host: str = LOOPBACK,
    extra_args: tuple[str, ...] = (),
    timeout_s: float = 20.0,
) -> Iterator[MooncakeMasterProcess]:
    """Run the real Mooncake master on free ports of `host`; stopped (and reaped) on exit."""
    with _log_dir(log_dir) as directory:
        master = _with_retries(lambda: _launch_mooncake_master(directory, host, list(extra_args), timeout_s))
        try:
            yield master
        finally:
            master.stop()


@dataclass
class RedisServerProcess:
    host: str
    port: int
    process: LocalProcess

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def kill(self) -> None:
        self.process.kill()

    def restart(self, timeout_s: float = 10.0) -> None:
        """Start it again on the same port, empty (fault injection: after kill())."""
        self.process.stop()
        self.process = LocalProcess(self.process.argv, self.process.log_path)
        self.process.wait_ready(lambda: _redis_ping(self.host, self.port), "redis-server", timeout_s)

    def stop(self) -> None:
        self.process.stop()


def redis_server_binary() -> str | None:
    return find_program("redis-server")


def _redis_ping(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.3) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def _launch_redis_server(log_dir: Path, host: str, timeout_s: float) -> RedisServerProcess:
    binary = redis_server_binary()
    if binary is None:
        raise ServiceStartError("redis-server not found on PATH (apt-get install redis-server)")
    port = free_port(host)
    argv = [
        binary,
        "--bind", host,
        "--port", str(port),
        # No persistence: a test or benchmark index must not outlive the run.
        "--save", "",
        "--appendonly", "no",
        "--dir", str(log_dir),
        "--protected-mode", "yes",
    ]
    server = RedisServerProcess(host, port, LocalProcess(argv, log_dir / f"redis-{port}.log"))
    try:
        server.process.wait_ready(lambda: _redis_ping(host, port), "redis-server", timeout_s)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def start_redis_server(
    log_dir: Path | None = None, host: str = LOOPBACK, timeout_s: float = 10.0
) -> Iterator[RedisServerProcess]:
    """Run a real redis-server without persistence on a free port of `host`; stopped on exit."""
    with _log_dir(log_dir) as directory:
        server = _with_retries(lambda: _launch_redis_server(directory, host, timeout_s))
        try:
            yield server
        finally:
            server.stop()

