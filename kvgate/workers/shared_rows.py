"""The load account's rows in shared memory: this worker writes its row, decisions sum them all."""

from __future__ import annotations

from collections.abc import Mapping

from kvgate.scheduler.account import ZERO, Counts
from kvgate.scheduler.types import EngineStats
from kvgate.workers.shared_table import SharedTable


class SharedRows:
    """`AccountRows` over a `SharedTable`. Rows 0..workers-1 are the workers'; the last row holds the
    other replicas' sums (account sync), written by the leader, the one worker that also scrapes
    engine stats and runs health checks."""

    def __init__(self, table: SharedTable, writer: int, leader: bool) -> None:
        self._table = table
        self._writer = writer
        self.leader = leader
        self._remote_row = table.writers - 1
        self._local_rows = range(self._remote_row)
        self._remote_ids: set[str] = set()

    def write(self, instance_id: str, counts: Counts) -> None:
        where = self._table.lookup(instance_id)
        if where is not None:  # a removed instance's row no longer counts anyway
            self._table.write_counts(self._writer, where[0], where[1], counts)

    def summed(self, instance_id: str) -> Counts:
        where = self._table.lookup(instance_id)
        return ZERO if where is None else self._table.summed_counts(*where)

    def local_totals(self) -> dict[str, Counts]:
        """Every worker's rows (the other replicas' excluded): what this replica publishes."""
        _, entries = self._table.entries()
        totals = {}
        for entry in entries:
            counts = self._table.summed_counts(entry.slot, entry.generation, self._local_rows)
            if counts != ZERO:
                totals[entry.config.id] = counts
        return totals

    def set_remote(self, totals: Mapping[str, Counts]) -> None:
        for instance_id in self._remote_ids - totals.keys():
            self._write_remote(instance_id, ZERO)
        for instance_id, counts in totals.items():
            self._write_remote(instance_id, counts)
        self._remote_ids = set(totals)

    def _write_remote(self, instance_id: str, counts: Counts) -> None:
        where = self._table.lookup(instance_id)
        if where is not None:
            self._table.write_counts(self._remote_row, where[0], where[1], counts)

    def observe_engine(self, instance_id: str, stats: EngineStats, now: float) -> None:
        where = self._table.lookup(instance_id)
        if where is not None:
            self._table.write_engine(where[0], where[1], stats, now)

    def engine(self, instance_id: str) -> EngineStats | None:
        where = self._table.lookup(instance_id)
        reported = None if where is None else self._table.read_engine(*where)
        return reported[0] if reported else None

    def expire_engine(self, older_than: float) -> None:
        if not self.leader:  # the engine area has one writer
            return
        _, entries = self._table.entries()
        for entry in entries:
            reported = self._table.read_engine(entry.slot, entry.generation)
            if reported is not None and reported[1] < older_than:
                self._table.forget_engine(entry.slot)
