"""The engine instances behind the gateway and what state each is in.

Instances come from the settings and change at run time through the admin routes. An instance
takes new requests only while it is healthy (active health checks) and not draining; requests
already sent to it always run to their end, whatever happens to it meanwhile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.config.instance_rules import redact_url
from kvgate.config.settings import InstanceConfig


@dataclass(slots=True)
class InstanceState:
    config: InstanceConfig
    # Optimistic at start: a dead instance costs one retried request before health checks see it.
    healthy: bool = True
    draining: bool = False
    consecutive_failures: int = 0

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def routable(self) -> bool:
        return self.healthy and not self.draining

    def describe(self) -> dict:
        return {
            "id": self.id,
            "url": redact_url(self.config.url),
            "model": self.config.model,
            "role": self.config.role.value,
            "kvs_endpoints": list(self.config.kvs_endpoints),
            "healthy": self.healthy,
            "draining": self.draining,
        }


class RegistryError(ValueError):
    """An admin change that cannot apply (unknown or duplicated id)."""


class InstanceRegistry:
    """Instance states by id, in configuration order (the scheduler's tie-breaks are deterministic)."""

    def __init__(
        self,
        instances: Sequence[InstanceConfig],
        on_change: Callable[[tuple[InstanceConfig, ...]], None] | None = None,
    ) -> None:
        self._states: dict[str, InstanceState] = {cfg.id: InstanceState(cfg) for cfg in instances}
        self._on_change = on_change
        self._served = frozenset(state.config.model for state in self._states.values())  # asked per request

    def get(self, instance_id: str) -> InstanceState | None:
        return self._states.get(instance_id)

    def states(self) -> list[InstanceState]:
        return list(self._states.values())

    def configs(self) -> tuple[InstanceConfig, ...]:
        return tuple(state.config for state in self._states.values())

    def models(self) -> list[str]:
        return sorted(self._served)

    def serves(self, model: str) -> bool:
        return model in self._served

    def routable(self, model: str) -> list[InstanceState]:
        return [s for s in self._states.values() if s.config.model == model and s.routable]

    def add(self, config: InstanceConfig) -> InstanceState:
        if config.id in self._states:
            raise RegistryError(f"instance {config.id!r} already exists")
        state = self._states[config.id] = InstanceState(config)
        self._changed()
        return state

    def remove(self, instance_id: str) -> InstanceState:
        state = self._states.pop(instance_id, None)
        if state is None:
            raise RegistryError(f"no instance {instance_id!r}")
        self._changed()
        return state

    def drain(self, instance_id: str) -> InstanceState:
        state = self._require(instance_id)
        state.draining = True
        return state

    def record_health(self, instance_id: str, ok: bool, failures_to_eject: int) -> None:
        """One health-check result: eject after `failures_to_eject` failures in a row, readmit on success."""
        state = self._states.get(instance_id)
        if state is None:  # removed while its check was in flight
            return
        if ok:
            state.consecutive_failures = 0
            state.healthy = True
        else:
            state.consecutive_failures += 1
            if state.consecutive_failures >= failures_to_eject:
                state.healthy = False

    def _require(self, instance_id: str) -> InstanceState:
        state = self._states.get(instance_id)
        if state is None:
            raise RegistryError(f"no instance {instance_id!r}")
        return state

    def _changed(self) -> None:
        self._served = frozenset(state.config.model for state in self._states.values())
        if self._on_change is not None:
            self._on_change(self.configs())
