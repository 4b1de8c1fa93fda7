"""The engine instances behind the gateway and what state each is in.

Instances come from the settings and change at run time through the admin routes. An instance
takes new requests only while it is healthy and not draining. It is ejected (unhealthy) by failed
active health checks, or by failed requests in a row (passive outlier detection, outliers.py), and
readmitted by a passing health check, an outlier only once its ejection period is over. Requests
already streaming from an instance run to their end whatever happens to it; those still waiting
for its first byte are failed over when it is ejected (`on_eject`).

Panic (as Envoy's panic threshold): when every instance of a model in one role (neutral, prefill or
decode) that is not draining is ejected, they all stay routable (`panic`) instead of failing every
request with 503/502. Health checks are a guess: on a busy machine a slow `/health` (engines in
their first NIXL handshake) ejected a whole healthy fleet at once. Requests waiting on an instance
whose ejection starts a panic are not failed over either: there is nowhere better to send them.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvgate.config.instance_rules import redact_url
from kvgate.config.settings import InstanceConfig


@dataclass(slots=True)
class InstanceState:
    config: InstanceConfig
    # Optimistic at start: a dead instance costs one retried request before health checks see it.
    healthy: bool = True
    draining: bool = False
    consecutive_failures: int = 0  # failed health checks in a row
    failed_requests: int = 0  # failed requests in a row (passive outlier detection)
    outlier_until: float = 0.0  # time.monotonic() before which health checks do not readmit it
    panic: bool = False  # ejected, yet routable: every instance of its model and role is ejected
    discovered: bool = False  # added by fleet discovery (kvgate/discovery/), which alone may remove it

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def routable(self) -> bool:
        return (self.healthy or self.panic) and not self.draining

    def describe(self) -> dict:
        return {
            "id": self.id,
            "url": redact_url(self.config.url),
            "model": self.config.model,
            "role": self.config.role.value,
            "kvs_endpoints": list(self.config.kvs_endpoints),
            "healthy": self.healthy,
            "draining": self.draining,
            "panic": self.panic,
        }


class LoraAdapter(NamedTuple):
    name: str
    path: str  # where the engines loaded it from: part of its block keys
    base_model: str


class RegistryError(ValueError):
    """An admin change that cannot apply (unknown or duplicated id)."""


class RegistryFull(RegistryError):
    """No room for the instance in the workers' shared table (fixed slots of a fixed size)."""


class InstanceRegistry:
    """Instance states by id, in configuration order (the scheduler's tie-breaks are deterministic)."""

    def __init__(
        self,
        instances: Sequence[InstanceConfig],
        on_change: Callable[[tuple[InstanceConfig, ...]], None] | None = None,
    ) -> None:
        self._states: dict[str, InstanceState] = {cfg.id: InstanceState(cfg) for cfg in instances}
        self._on_change = on_change
        self._served: frozenset[str] = frozenset()  # models and adapters, asked per request
        self._adapters: dict[str, LoraAdapter] = {}
        self._index_models()
        # Called when an instance goes from healthy to ejected (the gateway fails over its waiting requests).
        self.on_eject: Callable[[InstanceState], None] | None = None

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

    def lora_adapter(self, model: str) -> LoraAdapter | None:
        """The adapter a request's `model` names (None: a base model, or nothing served)."""
        return self._adapters.get(model)

    def routable(self, model: str) -> list[InstanceState]:
        """The instances that can serve `model`, a base model or one of their LoRA adapters."""
        return [s for s in self._states.values() if s.config.serves(model) and s.routable]

    def panicking(self, model: str) -> bool:
        """True while ejected instances of `model` are routed to because no instance of their role is healthy."""
        return any(s.panic for s in self._states.values() if s.config.serves(model))

    def add(self, config: InstanceConfig, discovered: bool = False) -> InstanceState:
        if config.id in self._states:
            raise RegistryError(f"instance {config.id!r} already exists")
        state = self._states[config.id] = InstanceState(config, discovered=discovered)
        self._changed()
        self.update_panic(config.model)
        return state

    def remove(self, instance_id: str) -> InstanceState:
        state = self._states.pop(instance_id, None)
        if state is None:
            raise RegistryError(f"no instance {instance_id!r}")
        self._changed()
        self.update_panic(state.config.model)
        return state

    def drain(self, instance_id: str) -> InstanceState:
        state = self._require(instance_id)
        state.draining = True
        self.update_panic(state.config.model)
        return state

    def update_panic(self, model: str | None = None) -> None:
        """Recompute `panic` for `model`'s instances (every model's when None) after a change of
        their health or draining."""
        states = [s for s in self._states.values() if model is None or s.config.model == model]
        healthy = {(s.config.model, s.config.role) for s in states if s.healthy and not s.draining}
        for state in states:
            state.panic = (not state.healthy and not state.draining
                           and (state.config.model, state.config.role) not in healthy)

    def record_health(self, instance_id: str, ok: bool, failures_to_eject: int) -> None:
        """One health-check result: eject after `failures_to_eject` failures in a row, readmit on
        success (an outlier once its ejection period is over)."""
        state = self._states.get(instance_id)
        if state is None:  # removed while its check was in flight
            return
        if ok:
            state.consecutive_failures = 0
            if not state.healthy and time.monotonic() >= state.outlier_until:
                state.healthy = True
                state.failed_requests = 0
                self.update_panic(state.config.model)
        else:
            state.consecutive_failures += 1
            if state.consecutive_failures >= failures_to_eject:
                self.eject(state)

    def eject(self, state: InstanceState, until: float = 0.0) -> None:
        """Take `state` out of routing until a health check passes (and `until`, a time.monotonic())."""
        state.outlier_until = max(state.outlier_until, until)
        if not state.healthy:
            return
        state.healthy = False
        self.update_panic(state.config.model)
        if self.on_eject is not None and not state.panic:
            self.on_eject(state)

    def _require(self, instance_id: str) -> InstanceState:
        state = self._states.get(instance_id)
        if state is None:
            raise RegistryError(f"no instance {instance_id!r}")
        return state

    def _index_models(self) -> None:
        configs = [state.config for state in self._states.values()]
        self._adapters = {name: LoraAdapter(name, path, config.model)
                          for config in configs for name, path in config.lora_adapters.items()}
        self._served = frozenset(config.model for config in configs) | frozenset(self._adapters)

    def _changed(self) -> None:
        self._index_models()
        if self._on_change is not None:
            self._on_change(self.configs())
