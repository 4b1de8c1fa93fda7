"""The directory a gateway's workers share (the table, its lock, the metric files), and the removal
of those a killed gateway left behind.

A supervisor removes its directory when it stops, but not when it is killed (kill -9, the OOM
killer): in /dev/shm such leftovers are memory, and they piled up by the dozen on one machine. So
each supervisor holds an exclusive lock on `owner.lock` in its directory for its whole life (the
kernel drops it when the process dies, however it dies), and every supervisor that starts removes
the directories whose lock nobody holds. A lock, not a pid: pids are reused, and a /dev/shm shared
between containers holds directories of processes this one cannot see.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "kvgate-workers-"
_OWNER_LOCK = "owner.lock"


class RunDir:
    """A fresh run directory, locked by this process until `remove`."""

    def __init__(self, parent: str | None = None) -> None:
        # Locked under a name no sweep matches, then renamed (the lock follows the file): another
        # gateway's sweep never sees this directory unlocked.
        starting = Path(tempfile.mkdtemp(prefix="." + PREFIX, dir=parent))
        self._owner = open(starting / _OWNER_LOCK, "w")  # noqa: SIM115 - held for the directory's life
        fcntl.flock(self._owner, fcntl.LOCK_EX)
        self.path = starting.with_name(starting.name[1:])
        starting.rename(self.path)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        self._owner.close()


def shared_memory_dir() -> str | None:
    """A tmpfs when there is one: the table and the metric files are memory, never disk I/O."""
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


def remove_abandoned(parent: str | None) -> int:
    """Remove the run directories under `parent` whose owner is dead; returns how many."""
    root = Path(parent or tempfile.gettempdir())
    removed = 0
    for path in root.glob(PREFIX + "*"):
        try:
            with open(path / _OWNER_LOCK) as owner:
                fcntl.flock(owner, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held while the owner lives
        except OSError:  # alive, another user's, still being created, or not ours at all
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed += 1
    if removed:
        log.warning("removed %d run directories of gateways that were killed (in %s)", removed, root)
    return removed
