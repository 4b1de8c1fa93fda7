"""Carry a mock engine's cache changes to the KV store index without slowing its steps.

The engine core reports added and evicted block keys synchronously, inside a step. Here they only
update a pending map (key -> should be published); a background task flushes that map to the store
in batches. A key added and evicted before a flush costs nothing, and a slow or failing store
delays the index, never the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from typing import Protocol

logger = logging.getLogger(__name__)


class BlockPublisher(Protocol):
    """Writes this engine's blocks into a KV store index (embedded, Redis, Mooncake)."""

    async def publish(self, keys: Sequence[str]) -> None: ...

    async def withdraw(self, keys: Sequence[str]) -> None: ...

    async def close(self) -> None: ...


class PublicationQueue:
    def __init__(self, publisher: BlockPublisher, name: str) -> None:
        self._publisher = publisher
        self._name = name
        self._pending: dict[str, bool] = {}
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"publish-{self._name}")

    def on_cache_change(self, added: list[str], evicted: list[str]) -> None:
        """The engine core's callback: the later state of a key wins."""
        pending = self._pending
        for key in evicted:
            pending[key] = False
        for key in added:
            pending[key] = True
        self._idle.clear()
        self._wake.set()

    async def flushed(self) -> None:
        """Wait until every change reported so far has been sent to the store (or failed)."""
        await self._idle.wait()

    async def _run(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()
            if not self._pending:
                self._idle.set()

    async def _flush(self) -> None:
        batch, self._pending = self._pending, {}
        removed = [key for key, present in batch.items() if not present]
        added = [key for key, present in batch.items() if present]
        try:
            if removed:
                await self._publisher.withdraw(removed)
            if added:
                await self._publisher.publish(added)
        except Exception as exc:  # the index is advice: log and carry on with the next batch
            logger.warning(
                "%s: publishing %d and withdrawing %d block keys failed: %s",
                self._name,
                len(added),
                len(removed),
                exc,
            )

    async def close(self, timeout_s: float = 5.0) -> None:
        """Let the batch in flight land, send what is pending, close the publisher (which withdraws
        this engine's blocks). Call after the engine has stopped changing its cache."""
        if self._task is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        if self._pending:
            await self._flush()
        self._idle.set()
        await self._publisher.close()
