"""An in-process block index: the demo's, the simulator's and tests' KV store.

It is a real index, not a stand-in: engines (or simulated engines) add and remove the blocks
they hold, and `query` answers from that state exactly as the other backends do. Endpoints of
a key come back sorted so answers are deterministic.

Not thread-safe: use it from one event loop (or one simulation thread).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvgate.kvs_client.base import Endpoints, HashedPrompt, KVSAnswer


class EmbeddedKVSIndex:
    name = "embedded"
    # `query` never awaits anything: the resilience wrapper arms no time budget for it.
    answers_inline = True

    def __init__(self) -> None:
        self._holders: dict[str, set[str]] = {}

    def add(self, keys: Iterable[str], endpoint: str) -> None:
        for key in keys:
            self._holders.setdefault(key, set()).add(endpoint)

    def remove(self, keys: Iterable[str], endpoint: str) -> None:
        for key in keys:
            holders = self._holders.get(key)
            if holders is None:
                continue
            holders.discard(endpoint)
            if not holders:
                del self._holders[key]

    def remove_endpoint(self, endpoint: str) -> None:
        """Forget everything an endpoint held (its engine stopped)."""
        emptied = []
        for key, holders in self._holders.items():
            holders.discard(endpoint)
            if not holders:
                emptied.append(key)
        for key in emptied:
            del self._holders[key]

    def holders(self, key: str) -> Endpoints:
        return tuple(sorted(self._holders.get(key, ())))

    def __len__(self) -> int:
        return len(self._holders)

    async def query(self, keys: Sequence[str], prompt: HashedPrompt | None = None) -> KVSAnswer:
        # Keyed by kvgate's block keys: the prompt they were hashed from is not needed.
        return KVSAnswer({key: self.holders(key) for key in keys if key in self._holders}, {})

    async def close(self) -> None:
        """Nothing to release; the index lives as long as its owner keeps it."""
