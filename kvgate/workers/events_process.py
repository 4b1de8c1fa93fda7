"""The KV events subscriber of a gateway with several workers: one process beside them.

Workers only read the events index; this process alone subscribes to the engines and writes it, so
a machine holds one subscription per engine whatever its worker count. It follows the fleet through
the workers' shared instance table: admin changes and health transitions reach it as they reach them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from dataclasses import dataclass
from multiprocessing.synchronize import Event

from prometheus_client import CollectorRegistry

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.kvs_client.events.index import EventsIndex
from kvgate.kvs_client.events.subscriber import EventsSubscriber
from kvgate.metrics.definitions import kv_events_metrics
from kvgate.processes import die_with
from kvgate.workers.shared_table import DRAINING, EJECTED, SharedTable


@dataclass(frozen=True)
class SubscriberSpec:
    index_path: str
    table_path: str
    lock_path: str
    log_level: str
    supervisor_pid: int


def run_events_subscriber(settings: Settings, spec: SubscriberSpec, ready: Event) -> None:
    """The spawned process's target: subscribe until SIGTERM, or until the supervisor dies."""
    die_with(spec.supervisor_pid)
    logging.basicConfig(level=spec.log_level,
                        format="%(asctime)s %(levelname)s kv-events %(name)s: %(message)s")
    asyncio.run(_subscribe(settings, spec, ready))


async def _subscribe(settings: Settings, spec: SubscriberSpec, ready: Event) -> None:
    index = EventsIndex.attach(spec.index_path)
    table = SharedTable.attach(spec.table_path, spec.lock_path)

    def instances() -> list[tuple[InstanceConfig, bool]]:
        _, entries = table.entries()
        return [(entry.config, not entry.flags & (DRAINING | EJECTED)) for entry in entries]

    # prometheus-client's multiprocess files (the supervisor's environment) carry the metrics to /metrics.
    subscriber = EventsSubscriber(index, settings, kv_events_metrics(CollectorRegistry()), instances)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    task = asyncio.create_task(subscriber.run(), name="kv events")
    ready.set()
    try:
        await stop.wait()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        table.close()
        index.close()
