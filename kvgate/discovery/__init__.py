"""Fleet discovery: instances added and removed at run time as a file or the Kubernetes API says.

One module per source (file.py, kubernetes.py), each turning what it reads into a desired fleet
(instance id -> InstanceConfig) that the reconciler applies to the gateway through the same
functions the admin routes use. `--discovery static` (the default) starts nothing: the fleet is
the `instances` setting and the admin routes alone. docs/DISCOVERY.md tells the operator's side.
"""

from __future__ import annotations

import asyncio

from prometheus_client import CollectorRegistry

from kvgate.config.settings import DiscoveryName, Settings
from kvgate.discovery.reconciler import FleetControl, FleetReconciler
from kvgate.metrics.definitions import discovery_metrics


def start_discovery(settings: Settings, fleet: FleetControl, prometheus: CollectorRegistry) -> asyncio.Task | None:
    """The task that follows the configured source (cancel it to stop), or None for --discovery static."""
    if settings.discovery == DiscoveryName.STATIC:
        return None
    metrics = discovery_metrics(prometheus)
    reconciler = FleetReconciler(fleet, metrics, settings.discovery.value)
    if settings.discovery == DiscoveryName.FILE:
        from kvgate.discovery.file import FileSource

        source = FileSource(settings.discovery_file, settings.discovery_file_poll_interval_s, metrics,
                            reconciler.apply)
    else:
        # Imported only when used: the Kubernetes client is a sizeable import.
        from kvgate.discovery.kubernetes import KubernetesSource

        source = KubernetesSource(settings, metrics, reconciler.apply)
    return asyncio.create_task(source.run(), name=f"discovery ({settings.discovery.value})")
