"""Applies a desired fleet, as a discovery source last saw it, to the running gateway.

The reconciler owns only the instances discovery added, which the registry marks (so the leader
worker of `kvgate serve --workers N`, restarted, takes up those it had added before): instances from
the settings' `instances` list or added through the admin routes are never touched, and a
discovered instance whose id is already taken by one of those is refused (logged and counted)
rather than replacing it. An instance whose configuration changed (a relabelled pod: new role or
model) is removed and added again; its requests already sent finish normally. Every change goes
through `FleetControl`, in the gateway the same functions the admin routes call
(kvgate/gateway/fleet/changes.py).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

from kvgate.config.settings import InstanceConfig
from kvgate.metrics.definitions import DiscoveryMetrics

log = logging.getLogger(__name__)


class FleetControl(Protocol):
    def ids(self) -> set[str]:
        """Every instance id the gateway holds now, discovered or not."""

    def discovered(self) -> Mapping[str, InstanceConfig]:
        """The instances discovery added and the gateway still holds, by id."""

    def add(self, config: InstanceConfig) -> None:
        """Add an instance; raises ValueError (refused, id taken, table full) saying why not."""

    def remove(self, instance_id: str) -> None:
        """Remove an instance; raises ValueError if there is none."""


class FleetReconciler:
    def __init__(self, fleet: FleetControl, metrics: DiscoveryMetrics, source: str) -> None:
        self._fleet = fleet
        self._metrics = metrics
        self._source = source
        # With --workers N the instances outlive the leader worker that follows the source: restarted,
        # it takes up those it had added (else it refused them as taken ids and never removed them).
        self._owned: dict[str, InstanceConfig] = dict(fleet.discovered())
        # Refused configurations are not tried again (nor logged again) until they change.
        self._refused: dict[str, InstanceConfig] = {}

    def apply(self, desired: Mapping[str, InstanceConfig]) -> None:
        """Make the discovered part of the fleet equal to `desired` (instance id -> config)."""
        present = self._fleet.ids()
        # An instance removed behind discovery's back (admin route) is added again if still desired.
        for gone in [i for i in self._owned if i not in present]:
            del self._owned[gone]
        for instance_id, config in list(self._owned.items()):
            if desired.get(instance_id) != config:
                self._remove(instance_id, replaced=instance_id in desired)
        self._refused = {i: c for i, c in self._refused.items() if desired.get(i) == c}
        present = self._fleet.ids()
        for instance_id, config in desired.items():
            if instance_id in self._owned or instance_id in self._refused:
                continue
            if instance_id in present:
                self._refuse(config, "instance_conflict", "its id is taken by an instance discovery did not add")
                continue
            try:
                self._fleet.add(config)
            except ValueError as exc:
                self._refuse(config, "instance_refused", str(exc))
                continue
            self._owned[instance_id] = config
            log.info("discovery (%s): added instance %s at %s (model %s, role %s)", self._source, instance_id,
                     config.url, config.model, config.role.value)
            self._metrics.changes.labels("added").inc()
        self._metrics.instances.set(len(self._owned))

    def _remove(self, instance_id: str, replaced: bool) -> None:
        del self._owned[instance_id]
        try:
            self._fleet.remove(instance_id)
        except ValueError:
            return  # removed meanwhile (admin route): nothing left to do
        if replaced:
            log.info("discovery (%s): instance %s changed; replacing it", self._source, instance_id)
            self._metrics.changes.labels("replaced").inc()
        else:
            log.info("discovery (%s): removed instance %s", self._source, instance_id)
            self._metrics.changes.labels("removed").inc()

    def _refuse(self, config: InstanceConfig, reason: str, why: str) -> None:
        self._refused[config.id] = config
        self._metrics.errors.labels(self._source, reason).inc()
        log.error("discovery (%s): instance %s not added: %s", self._source, config.id, why)
