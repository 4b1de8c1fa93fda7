"""The instance registry of a gateway with several workers: the shared table is the truth.

Every read first compares the table's epoch with the one this worker last saw (one word read), so
an admin change made through any worker, or a health transition seen by the leader, holds for this
worker's next request. Changes go to the table under its lock, then the local view follows.
"""

from __future__ import annotations

from collections.abc import Callable

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.fleet.registry import (
    InstanceRegistry,
    InstanceState,
    LoraAdapter,
    RegistryError,
    RegistryFull,
)
from kvgate.workers.shared_table import DISCOVERED, DRAINING, EJECTED, SharedTable, TableFull


class SharedRegistry(InstanceRegistry):
    def __init__(
        self,
        table: SharedTable,
        on_change: Callable[[tuple[InstanceConfig, ...]], None] | None = None,
    ) -> None:
        super().__init__((), on_change)
        self._table = table
        self._epoch = -1
        self._generations: dict[str, int] = {}
        self._sync()

    # --- reads: the table first ---

    def get(self, instance_id: str) -> InstanceState | None:
        self._sync()
        return super().get(instance_id)

    def states(self) -> list[InstanceState]:
        self._sync()
        return super().states()

    def configs(self) -> tuple[InstanceConfig, ...]:
        self._sync()
        return super().configs()

    def models(self) -> list[str]:
        self._sync()
        return super().models()

    def serves(self, model: str) -> bool:
        self._sync()
        return super().serves(model)

    def routable(self, model: str) -> list[InstanceState]:
        self._sync()
        return super().routable(model)

    def lora_adapter(self, model: str) -> LoraAdapter | None:
        self._sync()
        return super().lora_adapter(model)

    # --- changes: the table under its lock ---

    def add(self, config: InstanceConfig, discovered: bool = False) -> InstanceState:
        with self._table.changing():
            if self._table.find(config.id) is not None:
                raise RegistryError(f"instance {config.id!r} already exists")
            try:
                self._table.add(config, DISCOVERED if discovered else 0)
            except (TableFull, ValueError) as exc:
                raise RegistryFull(str(exc)) from None
        return self._require_synced(config.id)

    def remove(self, instance_id: str) -> InstanceState:
        state = self._require_synced(instance_id)
        with self._table.changing():
            entry = self._table.find(instance_id)
            if entry is None:
                raise RegistryError(f"no instance {instance_id!r}")
            self._table.remove(entry.slot)
        self._sync()
        return state

    def drain(self, instance_id: str) -> InstanceState:
        with self._table.changing():
            entry = self._table.find(instance_id)
            if entry is None:
                raise RegistryError(f"no instance {instance_id!r}")
            self._table.set_flags(entry.slot, entry.flags | DRAINING)
        return self._require_synced(instance_id)

    def record_health(self, instance_id: str, ok: bool, failures_to_eject: int) -> None:
        """Judged by the leader alone; a transition is written to the table for every worker."""
        state = self.get(instance_id)
        if state is None:
            return
        was_healthy = state.healthy
        super().record_health(instance_id, ok, failures_to_eject)
        if state.healthy == was_healthy:
            return
        with self._table.changing():
            entry = self._table.find(instance_id)
            if entry is not None:
                self._table.set_flags(entry.slot, (entry.flags & ~EJECTED) | (0 if state.healthy else EJECTED))

    def _require_synced(self, instance_id: str) -> InstanceState:
        self._sync()
        state = super().get(instance_id)
        if state is None:
            raise RegistryError(f"no instance {instance_id!r}")
        return state

    def _sync(self) -> None:
        if self._table.epoch == self._epoch:
            return
        epoch, entries = self._table.entries()
        states: dict[str, InstanceState] = {}
        generations: dict[str, int] = {}
        for entry in entries:
            state = self._states.get(entry.config.id)
            if state is None or self._generations.get(entry.config.id) != entry.generation:
                state = InstanceState(entry.config, discovered=bool(entry.flags & DISCOVERED))
            state.draining = bool(entry.flags & DRAINING)
            state.healthy = not entry.flags & EJECTED
            states[entry.config.id] = state
            generations[entry.config.id] = entry.generation
        changed = generations != self._generations
        self._states, self._generations, self._epoch = states, generations, epoch
        self.update_panic()
        if changed:
            self._changed()
