"""--discovery file: the fleet is an instance list file, re-read when it changes.

The file holds a YAML (or JSON) list of instances with the fields of the `instances` setting, or a
mapping with an `instances` key. It is checked every --discovery-file-poll-interval-s by modification
time, size and inode (os.stat follows symlinks, so a Kubernetes ConfigMap volume, updated by swapping
a symlink, is seen too). A file that cannot be read or holds an invalid instance changes nothing: the
last good fleet stays, the error is logged once per version of the file and counted.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Mapping

import yaml
from pydantic import TypeAdapter, ValidationError

from kvgate.config.settings import InstanceConfig
from kvgate.metrics.definitions import DiscoveryMetrics

log = logging.getLogger(__name__)

SOURCE = "file"
_INSTANCE_LIST = TypeAdapter(tuple[InstanceConfig, ...])

# (st_ino, st_mtime_ns, st_size), or the error that kept the file from being read.
_Signature = tuple[int, int, int] | str


class FleetFileError(ValueError):
    """The file cannot be read, or does not hold a valid instance list."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


def read_fleet_file(path: str) -> dict[str, InstanceConfig]:
    """The instances the file lists, by id; FleetFileError saying what is wrong otherwise."""
    try:
        with open(path, "rb") as handle:
            document = yaml.safe_load(handle)
    except OSError as exc:
        raise FleetFileError(f"cannot read {path}: {exc.strerror or exc}", "file_unreadable") from None
    except yaml.YAMLError as exc:
        raise FleetFileError(f"{path} is not valid YAML or JSON: {exc}", "file_invalid") from None
    if isinstance(document, dict) and set(document) == {"instances"}:
        document = document["instances"]
    if document is None:
        document = []
    if not isinstance(document, list):
        raise FleetFileError(f"{path} must hold a list of instances (or a mapping with an 'instances' key)",
                             "file_invalid")
    try:
        instances = _INSTANCE_LIST.validate_python(document)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise FleetFileError(f"{path}: invalid instance at '{where}': {first['msg']}", "file_invalid") from None
    ids = [instance.id for instance in instances]
    duplicated = sorted({i for i in ids if ids.count(i) > 1})
    if duplicated:
        raise FleetFileError(f"{path}: duplicated instance id(s) {duplicated}", "file_invalid")
    return {instance.id: instance for instance in instances}


class FileSource:
    def __init__(self, path: str, poll_interval_s: float, metrics: DiscoveryMetrics,
                 apply: Callable[[Mapping[str, InstanceConfig]], None]) -> None:
        self._path = path
        self._poll_interval_s = poll_interval_s
        self._metrics = metrics
        self._apply = apply
        self._seen: _Signature | None = None

    async def run(self) -> None:
        while True:
            self.poll()
            await asyncio.sleep(self._poll_interval_s)

    def poll(self) -> None:
        """Read the file again if it changed since the last poll."""
        try:
            stat = os.stat(self._path)
            signature: _Signature = (stat.st_ino, stat.st_mtime_ns, stat.st_size)
        except OSError as exc:
            signature = f"{type(exc).__name__}: {exc.strerror}"
        if signature == self._seen:
            return
        self._seen = signature
        try:
            desired = read_fleet_file(self._path)
        except FleetFileError as exc:
            self._metrics.errors.labels(SOURCE, exc.reason).inc()
            self._metrics.source_up.labels(SOURCE).set(0)
            log.error("discovery (file): %s; keeping the last good fleet", exc)
            return
        self._metrics.events.labels(SOURCE, "reload").inc()
        self._metrics.source_up.labels(SOURCE).set(1)
        log.info("discovery (file): %s lists %d instance(s)", self._path, len(desired))
        self._apply(desired)
