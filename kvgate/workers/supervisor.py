"""`kvgate serve --workers N`: start N gateway workers on one port, restart the ones that die.

The supervisor binds the port first (SO_REUSEPORT, never listening itself: it keeps the port and
resolves port 0), then spawns the workers, which bind the same port with SO_REUSEPORT so the kernel
spreads connections over them. It creates the shared table with the configured instances, and a
directory for prometheus-client's multiprocess files. A worker that dies is restarted after its
account rows and its rows of the API keys' in-flight counts are cleared (its requests died with it),
a table change it left half-done is completed (shared_table.py), and its live gauges are marked dead. SIGTERM and SIGINT are forwarded to
every worker, each of which drains as a single-process gateway does.

Workers die with the supervisor however it dies (kill -9, the OOM killer): each arms Linux's
parent-death signal when it starts, so no orphan keeps serving the port. The run directory of a
killed supervisor is removed by the next one that starts (run_dir.py).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from multiprocessing.synchronize import Event

from kvgate.config.api_keys import load_api_keys
from kvgate.config.settings import Settings
from kvgate.kvs_client.events import events_enabled
from kvgate.kvs_client.events.index import EventsIndex
from kvgate.workers.events_process import SubscriberSpec, run_events_subscriber
from kvgate.workers.run_dir import RunDir, remove_abandoned, shared_memory_dir
from kvgate.workers.shared_key_limits import SharedKeyLimits, key_slots
from kvgate.workers.shared_table import SharedTable
from kvgate.workers.worker import WorkerSpec, run_worker

log = logging.getLogger(__name__)

_START_TIMEOUT_S = 180.0  # loading a tokenizer on a busy machine takes seconds
# Beyond --shutdown-grace-s, for the drain's own end and the process's exit.
_STOP_MARGIN_S = 30.0


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, which containers and taskset narrow)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def reserve_port(host: str, port: int) -> socket.socket:
    """A bound, non-listening SO_REUSEPORT socket: it holds the port while workers come and go.

    The port is first bound without SO_REUSEPORT, which fails if anything holds it, another
    gateway with SO_REUSEPORT included: two gateways must never share a port by accident. The probe
    sets SO_REUSEADDR, which still fails on a socket bound or listening there, but not on the
    connections a killed gateway left in TIME_WAIT (a restart would wait a minute for them).
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
        port = probe.getsockname()[1]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


class Supervisor:
    def __init__(self, settings: Settings, workers: int, log_level: str) -> None:
        self._port_holder = reserve_port(settings.host, settings.port)  # first: the likeliest to fail
        shm_dir = shared_memory_dir()
        remove_abandoned(shm_dir)
        self._run = RunDir(shm_dir)
        self._run_dir = self._run.path
        self._metrics_dir = self._run_dir / "metrics"
        self._metrics_dir.mkdir()
        # prometheus-client picks its multiprocess storage when imported: the workers inherit this.
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(self._metrics_dir)
        self._settings = settings.model_copy(update={"port": self._port_holder.getsockname()[1]})
        # Rows 0..N-1 are the workers', row N the other replicas' sums (written by worker 0).
        self._table = SharedTable.create(str(self._run_dir / "table"), settings.workers_max_instances, workers + 1,
                                         str(self._run_dir / "lock"))
        with self._table.changing():
            for instance in settings.instances:
                self._table.add(instance)
        # The API keys' limits, counted by every worker (slots for the keys at start and keys added later).
        self._key_limits: SharedKeyLimits | None = None
        if settings.api_keys_file:
            self._key_limits = SharedKeyLimits.create(
                str(self._run_dir / "key-limits"), key_slots(len(load_api_keys(settings.api_keys_file))), workers,
                str(self._run_dir / "key-limits.lock"))
        # The engines' KV events: one index in shared memory, written by one subscriber process.
        self._events_path = ""
        if events_enabled(settings):
            self._events_path = str(self._run_dir / "events")
            EventsIndex.create(settings.kv_events_index_bytes, settings.kv_events_max_instances,
                               self._events_path).close()
        self._subscriber: BaseProcess | None = None
        self._context = multiprocessing.get_context("spawn")
        self._count = workers
        self._log_level = log_level
        self._processes: list[BaseProcess] = []
        self._stopping = False
        self._stop_timeout_s = settings.shutdown_grace_s + _STOP_MARGIN_S

    @property
    def url(self) -> str:
        return f"http://{self._settings.host}:{self._settings.port}"

    def run(self) -> int:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._stop)
        try:
            if not self._start_all():
                return 1
            if self._stopping:
                return 0
            print(f"kvgate gateway listening on {self.url}", flush=True)
            log.info("kvgate gateway listening on %s with %d workers", self.url, self._count)
            return self._watch()
        finally:
            self._shutdown()

    def _spawn(self, index: int) -> tuple[BaseProcess, Event]:
        spec = WorkerSpec(index, self._table.path, str(self._run_dir / "lock"), str(self._metrics_dir),
                          self._log_level, supervisor_pid=os.getpid(), events_index_path=self._events_path,
                          key_limits_path=self._key_limits.path if self._key_limits else "",
                          key_limits_lock_path=self._key_limits.lock_path if self._key_limits else "")
        ready = self._context.Event()
        process = self._context.Process(target=run_worker, args=(self._settings, spec, ready),
                                        name=f"kvgate-worker-{index}", daemon=False)
        process.start()
        return process, ready

    def _spawn_subscriber(self) -> tuple[BaseProcess, Event]:
        spec = SubscriberSpec(self._events_path, self._table.path, str(self._run_dir / "lock"), self._log_level,
                              supervisor_pid=os.getpid())
        ready = self._context.Event()
        process = self._context.Process(target=run_events_subscriber, args=(self._settings, spec, ready),
                                        name="kvgate-kv-events", daemon=False)
        process.start()
        return process, ready

    def _start_all(self) -> bool:
        started = [self._spawn(index) for index in range(self._count)]
        self._processes = [process for process, _ in started]
        if self._events_path:
            self._subscriber, subscriber_ready = self._spawn_subscriber()
            started.append((self._subscriber, subscriber_ready))
        deadline = time.monotonic() + _START_TIMEOUT_S
        for process, ready in started:
            while not ready.wait(0.2):
                if self._stopping:  # asked to stop while starting: a clean stop
                    return True
                if not process.is_alive() or time.monotonic() > deadline:
                    log.error("worker %s did not start (exit code %s)", process.name, process.exitcode)
                    return False
        return True

    def _watch(self) -> int:
        while not self._stopping:
            wait([process.sentinel for process in self._all()], timeout=0.5)
            for index, process in enumerate(self._processes):
                if process.is_alive() or self._stopping:
                    continue
                log.warning("worker %d (pid %s) died with exit code %s; clearing its rows and restarting it",
                            index, process.pid, process.exitcode)
                self._forget(index, process)
                self._processes[index], _ = self._spawn(index)
            subscriber = self._subscriber
            if subscriber is not None and not subscriber.is_alive() and not self._stopping:
                from prometheus_client import multiprocess

                log.warning("the KV events subscriber (pid %s) died with exit code %s; restarting it",
                            subscriber.pid, subscriber.exitcode)
                if subscriber.pid is not None:
                    multiprocess.mark_process_dead(subscriber.pid, str(self._metrics_dir))
                self._subscriber, _ = self._spawn_subscriber()
        return 0

    def _forget(self, index: int, process: BaseProcess) -> None:
        """What a dead worker leaves behind: its account row, its remote row if it led, its requests in
        the API keys' in-flight counts, its gauges."""
        from prometheus_client import multiprocess

        with self._table.changing():  # the kernel released the lock if the worker died holding it
            if self._table.recover():
                log.warning("worker %d died inside a change of the instance table; the change is void or "
                            "complete, and the table readable again", index)
        self._table.clear_writer(index)
        if index == 0:
            self._table.clear_writer(self._count)
        if self._key_limits is not None:
            self._key_limits.clear_writer(index)
        if process.pid is not None:
            multiprocess.mark_process_dead(process.pid, str(self._metrics_dir))

    def _stop(self, signum: int, _frame: object) -> None:
        """Every SIGTERM/SIGINT goes to every worker: the first starts their drain, a second ends its
        grace period at once, as for a single-process gateway."""
        self._stopping = True
        self._signal_workers()

    def _all(self) -> list[BaseProcess]:
        """The workers, and the events subscriber when there is one."""
        return self._processes + ([self._subscriber] if self._subscriber is not None else [])

    def _signal_workers(self) -> None:
        for process in self._all():
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, signal.SIGTERM)

    def _shutdown(self) -> None:
        if not self._stopping:  # leaving on an error: the workers have not been told yet
            self._stopping = True
            self._signal_workers()
        deadline = time.monotonic() + self._stop_timeout_s
        for process in self._all():
            process.join(max(deadline - time.monotonic(), 0.1))
            if process.is_alive():
                log.error("worker %s did not stop in %.0fs; killing it", process.name, self._stop_timeout_s)
                process.kill()
                process.join()
        self._port_holder.close()
        self._table.close()
        if self._key_limits is not None:
            self._key_limits.close()
        self._run.remove()


def run_workers(settings: Settings, workers: int, log_level: str) -> int:
    try:
        supervisor = Supervisor(settings, workers, log_level)
    except OSError as exc:  # the port is taken, or the host is not an address of this machine
        print(f"kvgate serve: cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 2
    return supervisor.run()
