"""The memory workers share: one account across writers, the instance table, dead writers, reused slots."""

from __future__ import annotations

import pytest

from kvgate.config import InstanceConfig
from kvgate.gateway.fleet.registry import RegistryError
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.types import EngineStats, InstanceLoad
from kvgate.workers.shared_registry import SharedRegistry
from kvgate.workers.shared_rows import SharedRows
from kvgate.workers.shared_table import SharedTable


def instance(instance_id: str, model: str = "m") -> InstanceConfig:
    return InstanceConfig(id=instance_id, url=f"http://127.0.0.1:9/{instance_id}", model=model)


@pytest.fixture
def table(tmp_path):
    created = SharedTable.create(str(tmp_path / "table"), capacity=4, writers=3, lock_path=str(tmp_path / "lock"))
    with created.changing():
        created.add(instance("a"))
        created.add(instance("b"))
    yield created
    created.close()


def worker_account(table: SharedTable, writer: int, tmp_path) -> LoadAccount:
    """An account as one worker holds it: its own view of the same file."""
    view = SharedTable.attach(table.path, str(tmp_path / "lock"))
    return LoadAccount(10, SharedRows(view, writer=writer, leader=writer == 0))


def test_a_dispatch_in_one_worker_is_in_the_next_decision_of_another(table, tmp_path):
    first, second = worker_account(table, 0, tmp_path), worker_account(table, 1, tmp_path)
    first.dispatch("r1", "a", 300, now=0)
    second.dispatch("r2", "a", 100, now=0)
    second.first_token("r2", now=1)
    expected = InstanceLoad(num_requests=2, num_waiting_requests=1, all_prefills_tokens_num=300)
    assert first.load("a") == second.load("a") == expected
    assert first.inflight("a") == second.inflight("a") == (2, 300)
    first.release("r1")
    second.release("r2")
    for account in (first, second):
        assert account.load("a") == InstanceLoad() and account.total_inflight() == 0


def test_a_dead_writers_rows_are_cleared(table, tmp_path):
    dead, alive = worker_account(table, 0, tmp_path), worker_account(table, 1, tmp_path)
    dead.dispatch("r1", "a", 300, now=0)
    dead.dispatch("r2", "b", 50, now=0)
    alive.dispatch("r3", "a", 10, now=0)
    table.clear_writer(0)  # what the supervisor does before restarting worker 0
    assert alive.inflight("a") == (1, 10) and alive.inflight("b") == (0, 0)


def test_rows_of_a_removed_instance_never_count_for_the_one_reusing_its_slot(table, tmp_path):
    account = worker_account(table, 1, tmp_path)
    account.dispatch("r1", "b", 300, now=0)
    with table.changing():
        table.remove(table.find("b").slot)
        table.add(instance("c"))  # takes b's slot, the first free one
    assert account.inflight("c") == (0, 0) and account.inflight("b") == (0, 0)
    account.release("r1")  # the late release of a request sent to b harms nothing
    account.dispatch("r2", "c", 7, now=1)
    assert account.inflight("c") == (1, 7)


def test_engine_reports_are_written_by_the_leader_and_read_by_all(table, tmp_path):
    leader, other = worker_account(table, 0, tmp_path), worker_account(table, 1, tmp_path)
    leader.observe_engine("a", EngineStats(4, 2, 0.5), now=100)
    assert other.load("a") == InstanceLoad(6, 2, 0, 0.5)
    other.expire(now=200)  # not the engine area's writer: changes nothing
    assert other.load("a") == InstanceLoad(6, 2, 0, 0.5)
    leader.expire(now=200)
    assert other.load("a") == InstanceLoad()


def test_the_remote_row_folds_other_replicas_in(table, tmp_path):
    leader, other = worker_account(table, 0, tmp_path), worker_account(table, 1, tmp_path)
    leader.dispatch("r1", "a", 10, now=0)
    other.dispatch("r2", "a", 20, now=0)
    rows = leader.rows
    rows.set_remote({"a": (5, 5, 500), "gone": (1, 1, 1)})
    assert other.inflight("a") == (7, 530)
    assert rows.local_totals() == {"a": (2, 2, 30)}  # what this replica publishes: its own only
    rows.set_remote({})
    assert other.inflight("a") == (2, 30)


def test_admin_changes_made_through_one_worker_hold_in_every_other(table, tmp_path):
    changes = []
    first = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    second = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")), on_change=changes.append)
    assert [s.id for s in second.states()] == ["a", "b"]
    first.add(instance("c", model="m2"))
    assert second.serves("m2") and [c.id for c in changes[-1]] == ["a", "b", "c"]
    with pytest.raises(RegistryError):
        second.add(instance("c"))
    first.drain("a")
    assert [s.id for s in second.routable("m")] == ["b"]
    second.remove("c")
    assert not first.serves("m2") and first.get("c") is None
    with pytest.raises(RegistryError):
        first.remove("c")


def test_health_judged_by_the_leader_holds_everywhere(table, tmp_path):
    leader = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    other = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    leader.record_health("b", ok=False, failures_to_eject=2)
    assert other.get("b").healthy
    leader.record_health("b", ok=False, failures_to_eject=2)
    assert not other.get("b").healthy and [s.id for s in other.routable("m")] == ["a"]
    leader.record_health("b", ok=True, failures_to_eject=2)
    assert other.get("b").healthy


def test_an_instance_discovery_added_stays_marked_so_for_every_worker(table, tmp_path):
    """The mark is what a restarted leader worker takes its discovered instances up by."""
    leader = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    leader.add(instance("c"), discovered=True)
    leader.record_health("c", ok=False, failures_to_eject=1)
    leader.drain("c")
    restarted = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    assert [s.id for s in restarted.states() if s.discovered] == ["c"]
    assert not restarted.get("c").healthy and restarted.get("c").draining


def test_a_full_table_refuses_the_instance(table, tmp_path):
    registry = SharedRegistry(SharedTable.attach(table.path, str(tmp_path / "lock")))
    registry.add(instance("c"))
    registry.add(instance("d"))
    with pytest.raises(RegistryError, match="workers-max-instances"):
        registry.add(instance("e"))


def test_readers_never_see_a_half_written_table(table, tmp_path):
    """A writer keeps adding and removing an instance with a long configuration while a reader
    reads the table: every snapshot is whole (a and b always, c either whole or absent)."""
    import threading

    writer_view = SharedTable.attach(table.path, str(tmp_path / "lock"))
    reader_view = SharedTable.attach(table.path, str(tmp_path / "lock"))
    long_config = InstanceConfig(id="c", url="http://127.0.0.1:9/c", model="m",
                                 kvs_endpoints=tuple(f"127.0.1.{n}" for n in range(60)))
    stop = threading.Event()

    def churn() -> None:
        for _ in range(300):
            with writer_view.changing():
                writer_view.add(long_config)
            with writer_view.changing():
                writer_view.remove(writer_view.find("c").slot)
        stop.set()

    thread = threading.Thread(target=churn)
    thread.start()
    snapshots = 0
    while not stop.is_set() or snapshots == 0:
        _, entries = reader_view.entries()
        ids = [entry.config.id for entry in entries]
        assert ids[:2] == ["a", "b"] and ids[2:] in ([], ["c"])
        if ids[2:]:
            assert entries[2].config == long_config
        snapshots += 1
    thread.join()
