"""`kvgate serve --workers N` when something is killed: a worker inside a table change, the supervisor."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import orjson
import pytest

from kvgate.config import InstanceConfig
from kvgate.processes import free_port
from kvgate.workers import shared_table
from kvgate.workers.run_dir import PREFIX, RunDir, remove_abandoned
from kvgate.workers.shared_table import DRAINING, SharedTable
from kvgate.workers.worker import WORKER_HEADER
from tests.scripted_upstream import MODEL, ScriptedUpstream

pytestmark = pytest.mark.timeout(180)


def _change_and_die(table_path: str, lock_path: str) -> None:
    """A writer killed between the two epoch increments of a change, as a crash or the OOM killer does."""
    table = SharedTable.attach(table_path, lock_path)
    with table.changing(), table._writing():
        os.kill(os.getpid(), signal.SIGKILL)


def test_a_writer_killed_inside_a_change_leaves_a_table_the_supervisor_recovers(tmp_path, monkeypatch):
    table = SharedTable.create(str(tmp_path / "table"), capacity=4, writers=3, lock_path=str(tmp_path / "lock"))
    with table.changing():
        table.add(InstanceConfig(id="a", url="http://127.0.0.1:9", model="m"))
    writer = multiprocessing.get_context("spawn").Process(target=_change_and_die,
                                                          args=(table.path, str(tmp_path / "lock")))
    writer.start()
    writer.join(60)
    assert writer.exitcode == -signal.SIGKILL
    assert table.epoch % 2 == 1
    monkeypatch.setattr(shared_table, "_READ_TIMEOUT_S", 0.2)
    with pytest.raises(RuntimeError, match="kept changing"):
        table.entries()  # what every worker's next read did, forever
    with table.changing():  # the kernel released the dead writer's lock
        assert table.recover()
    _, entries = table.entries()
    assert [e.config.id for e in entries] == ["a"]
    with table.changing():  # and the next change works
        assert not table.recover()
        table.set_flags(entries[0].slot, DRAINING)
    assert table.entries()[1][0].flags & DRAINING
    table.close()


def test_run_directories_are_removed_once_their_owner_is_dead(tmp_path):
    mine = RunDir(str(tmp_path))
    # One left by a killed gateway: its owner lock is held by nobody.
    abandoned = tmp_path / (PREFIX + "killed")
    abandoned.mkdir()
    (abandoned / "owner.lock").touch()
    (abandoned / "table").write_bytes(b"\0" * 4096)
    assert remove_abandoned(str(tmp_path)) == 1
    assert not abandoned.exists() and mine.path.exists()  # a live owner's stays
    mine.remove()
    assert list(tmp_path.iterdir()) == []


# --- a real gateway of two workers ---


@pytest.fixture
async def upstream() -> AsyncIterator[ScriptedUpstream]:
    engine = await ScriptedUpstream("e0").start()
    yield engine
    await engine.close()


def start_gateway(tmp_path: Path, upstream_url: str, port: int, name: str) -> subprocess.Popen:
    config = tmp_path / f"{name}.yaml"
    config.write_text(orjson.dumps({
        "port": port, "workers": 2, "admin_token": "t", "kvs_backend": "embedded", "workers_max_instances": 4,
        "stats_poll_interval_s": 60, "health_check_interval_s": 60,
        "instances": [{"id": "e0", "url": upstream_url, "model": MODEL}],
    }).decode())
    return subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                            stdout=subprocess.PIPE, stderr=open(tmp_path / f"{name}.log", "w"), text=True,  # noqa: SIM115
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})


async def wait_listening(process: subprocess.Popen, url: str) -> None:
    line = await asyncio.wait_for(asyncio.to_thread(process.stdout.readline), timeout=120)
    assert line.strip() == f"kvgate gateway listening on {url}"


async def worker_pids(url: str) -> dict[str, int]:
    """Worker index -> pid, from the header each answer carries (fresh connections until both answered)."""
    seen: dict[str, int] = {}
    deadline = time.monotonic() + 60
    while len(seen) < 2:
        assert time.monotonic() < deadline, f"only workers {sorted(seen)} answered"
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as session, \
                session.post(url + "/debug/schedule", json={"model": MODEL, "prompt": "hi", "max_tokens": 1}) as r:
            assert r.status == 200, await r.text()
            index, pid = r.headers[WORKER_HEADER].split(":")
            seen[index] = int(pid)
    return seen


def run_dir_of(worker_pid: int) -> Path:
    environ = Path(f"/proc/{worker_pid}/environ").read_bytes().split(b"\0")
    metrics_dir = next(v for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
    return Path(metrics_dir.split(b"=", 1)[1].decode()).parent


def running(pid: int) -> bool:
    try:
        state = next(line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("State"))
    except FileNotFoundError:
        return False
    return " Z " not in state and "zombie" not in state


def port_free(port: int) -> bool:
    """Nothing listens or holds it (the connections the killed workers left in TIME_WAIT do not count)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


async def test_a_killed_worker_and_a_killed_supervisor_leave_nothing_behind(tmp_path, upstream):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    first = start_gateway(tmp_path, upstream.url, port, "first")
    second: subprocess.Popen | None = None
    try:
        await wait_listening(first, url)
        pids = await worker_pids(url)
        run_dir = run_dir_of(pids["0"])
        # Worker 1 dies inside a table change: the lock it held, the epoch left odd.
        table = SharedTable.attach(str(run_dir / "table"), str(run_dir / "lock"))
        with table.changing():
            table._q[0] += 1
            os.kill(pids["1"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while table.epoch % 2:
            assert time.monotonic() < deadline, "the supervisor left the half-written table as it was"
            await asyncio.sleep(0.05)
        table.close()
        # Every worker reads the table again (the restarted one too), and changes go on.
        assert set(await worker_pids(url)) == {"0", "1"}
        async with aiohttp.ClientSession() as session:
            added = await session.post(url + "/admin/instances", headers={"Authorization": "Bearer t"},
                                       json={"id": "e1", "url": upstream.url, "model": MODEL})
            assert added.status == 201, await added.text()
        pids = await worker_pids(url)

        # kill -9 of the supervisor: its workers die at once, and the port is free again.
        first.kill()
        first.wait(10)
        deadline = time.monotonic() + 10
        while any(running(pid) for pid in pids.values()) or not port_free(port):
            assert time.monotonic() < deadline, "workers outlived their supervisor"
            await asyncio.sleep(0.05)
        assert run_dir.exists()  # nobody could remove it: the next gateway does
        second = start_gateway(tmp_path, upstream.url, port, "second")
        await wait_listening(second, url)
        assert not run_dir.exists()
        second_dir = run_dir_of((await worker_pids(url))["0"])
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0
        assert not second_dir.exists()
    finally:
        for process in (first, second):
            if process is not None and process.poll() is None:
                process.kill()
                process.wait()
    assert "died inside a change of the instance table" in (tmp_path / "first.log").read_text()
