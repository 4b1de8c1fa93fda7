"""One worker process of `kvgate serve --workers N`: a whole gateway over the shared table."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from multiprocessing.synchronize import Event

from aiohttp import web

from kvgate.config.settings import Settings
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.http.key_limits import TokenBucket
from kvgate.processes import die_with
from kvgate.workers.shared_key_limits import SharedKeyLimit, SharedKeyLimits
from kvgate.workers.shared_registry import SharedRegistry
from kvgate.workers.shared_rows import SharedRows
from kvgate.workers.shared_table import SharedTable
from kvgate.workers.whole_metrics import whole_gateway_metrics

WORKER_HEADER = "X-Kvgate-Worker"


@dataclass(frozen=True)
class WorkerSpec:
    """What the supervisor tells a worker (picklable: workers are spawned, not forked)."""

    index: int
    table_path: str
    lock_path: str
    metrics_dir: str
    log_level: str
    supervisor_pid: int
    # The events index the supervisor's subscriber process writes; empty when events are off.
    events_index_path: str = ""
    # The API keys' shared limits and their lock; empty without --api-keys-file.
    key_limits_path: str = ""
    key_limits_lock_path: str = ""


@dataclass
class WorkerShare:
    """What a worker's gateway shares with the others; `build_app` takes it instead of local parts."""

    spec: WorkerSpec
    table: SharedTable
    rows: SharedRows
    key_limits: SharedKeyLimits | None = None

    def __post_init__(self) -> None:
        self._tag = f"{self.spec.index}:{os.getpid()}"

    @property
    def leader(self) -> bool:
        """The one worker that runs health checks, engine-stats scraping and the account sync."""
        return self.rows.leader

    @property
    def events_index_path(self) -> str:
        return self.spec.events_index_path

    def key_limit(self, digest: bytes, rate: float, burst: int, now: float) -> SharedKeyLimit | None:
        limits = self.key_limits
        slot = None if limits is None else limits.claim(digest, burst, now)
        if limits is None or slot is None:
            return None
        return SharedKeyLimit(limits, slot, self.spec.index, TokenBucket(rate, burst, now) if rate else None)

    def registry(self, on_change) -> SharedRegistry:
        return SharedRegistry(self.table, on_change)

    def whole_metrics(self, registry: InstanceRegistry) -> bytes:
        return whole_gateway_metrics(self.spec.metrics_dir, self.rows, registry)

    async def tag_response(self, _request: web.Request, response: web.StreamResponse) -> None:
        """Every answer names the worker that gave it ("<index>:<pid>"), for operators and tests."""
        response.headers[WORKER_HEADER] = self._tag


def run_worker(settings: Settings, spec: WorkerSpec, ready: Event) -> None:
    """The spawned process's target: load the tokenizer, attach the table, serve until SIGTERM."""
    die_with(spec.supervisor_pid)  # first: an orphan would keep the port and the table
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s worker-{spec.index} %(name)s: %(message)s")
    _read_pid_once_for_metrics()
    from kvgate.gateway.http.server import run_gateway
    from kvgate.gateway.planning.tokenizer import load_tokenizer

    if settings.access_log:
        from kvgate.gateway.http.access_log import configure_logger

        configure_logger()
    tokenizer = load_tokenizer(settings.tokenizer, settings.chat_template)
    table = SharedTable.attach(spec.table_path, spec.lock_path)
    key_limits = (SharedKeyLimits(spec.key_limits_path, spec.key_limits_lock_path)
                  if spec.key_limits_path else None)
    share = WorkerShare(spec, table, SharedRows(table, writer=spec.index, leader=spec.index == 0), key_limits)
    try:
        code = run_gateway(settings, tokenizer, shared=share, on_ready=ready.set)
    finally:
        table.close()
        if key_limits is not None:
            key_limits.close()
    sys.exit(code)


def _read_pid_once_for_metrics() -> None:
    """prometheus-client's multiprocess values read the process id (a getpid() system call) on every
    increment, to notice a fork; a request makes about 24 increments. A worker is spawned and never
    forks, so its id is read once, through the library's own `process_identifier` parameter. Runs
    before any metric exists: each takes its value class when created."""
    from prometheus_client import values

    pid = os.getpid()
    values.ValueClass = values.MultiProcessValue(process_identifier=lambda: pid)
