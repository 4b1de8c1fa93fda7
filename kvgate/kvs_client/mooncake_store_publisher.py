"""Publish block keys into a real Mooncake store from a given loopback IP.

A mock engine (or a test) that "holds" KV blocks makes the Mooncake master report them the
way a real engine's connector would: each key is `put` with `ReplicateConfig.preferred_segment`
set to this client's own "IP:port", so `/batch_query_keys` answers with
`transport_endpoint_ == "IP:port"`. Several publishers on one machine use different loopback
IPs (127.0.0.2, 127.0.0.3, ...) and look to the master exactly like separate hosts.

Behaviour of `mooncake.store.MooncakeDistributedStore` this module relies on (measured with
mooncake-transfer-engine-non-cuda 0.3.13):
- several clients can live in one process, each with its own segment;
- objects vanish when their client closes (close takes ~2 s; ~17 s if the master is gone,
  which is why tests run publishers in child processes, see publisher_process.py);
- a key is stored once: putting a key another client already holds succeeds without moving it;
- calls block, so async callers go through the publisher's own single worker thread.

The transfer engine normally advertises the first LAN interface as its RPC address;
`MC_LEGACY_RPC_PORT_BINDING=1` makes it use the IP:port of `local_hostname` instead, which
keeps the advertised address on loopback. (Its listening sockets bind the wildcard address
either way; that is Mooncake's choice, not configurable from here.)
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvgate.processes import free_port

# Mooncake status codes seen by callers (mooncake-store/include/types.h).
OBJECT_NOT_FOUND = -704
_MIB = 1024 * 1024
# put_batch sends one RPC per call; chunking keeps each below the local buffer size.
_PUT_BATCH_KEYS = 4096


class MooncakeStoreError(RuntimeError):
    """setup/put/remove on the Mooncake store failed."""


class MooncakeStorePublisher:
    """One Mooncake store client bound to `local_ip`, writing small placeholder values.

    Use as a context manager or call close(). Methods starting with `a` run the blocking call
    on this publisher's single worker thread, keeping calls ordered and the event loop free.
    """

    def __init__(
        self,
        local_ip: str,
        master_rpc_address: str,
        metadata_url: str,
        *,
        port: int | None = None,
        value_bytes: int = 64,
        segment_bytes: int = 64 * _MIB,
        local_buffer_bytes: int = 16 * _MIB,
    ) -> None:
        self.local_ip = local_ip
        self.master_rpc_address = master_rpc_address
        self.metadata_url = metadata_url
        self.port = port or free_port(local_ip)
        self.segment_bytes = segment_bytes
        self.local_buffer_bytes = local_buffer_bytes
        self._value = b"\0" * value_bytes
        self._store: Any = None
        self._config: Any = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mooncake-pub-{local_ip}")

    @property
    def endpoint(self) -> str:
        """The "IP:port" the master reports as `transport_endpoint_` for this client's keys."""
        return f"{self.local_ip}:{self.port}"

    # --- blocking API ---

    def open(self) -> MooncakeStorePublisher:
        try:
            from mooncake.store import MooncakeDistributedStore, ReplicateConfig
        except ImportError as exc:
            raise MooncakeStoreError(
                f"mooncake.store unavailable ({exc}); pip install mooncake-transfer-engine-non-cuda"
            ) from exc
        os.environ.setdefault("MC_LEGACY_RPC_PORT_BINDING", "1")
        store = MooncakeDistributedStore()
        status = store.setup(
            self.endpoint,
            self.metadata_url,
            self.segment_bytes,
            self.local_buffer_bytes,
            "tcp",
            "",
            self.master_rpc_address,
        )
        if status != 0:
            raise MooncakeStoreError(
                f"MooncakeDistributedStore.setup({self.endpoint}, master {self.master_rpc_address}) returned {status}"
            )
        config = ReplicateConfig()
        config.replica_num = 1
        config.preferred_segment = self.endpoint
        self._store, self._config = store, config
        return self

    def publish(self, keys: Sequence[str], replica_num: int = 1) -> list[str]:
        """Put each key on this client's segment (and `replica_num - 1` others, as the master
        places them); returns the keys that could not be stored."""
        store = self._require_open()
        config = self._config if replica_num == 1 else self._replicated(replica_num)
        failed: list[str] = []
        for start in range(0, len(keys), _PUT_BATCH_KEYS):
            chunk = list(keys[start : start + _PUT_BATCH_KEYS])
            if store.put_batch(chunk, [self._value] * len(chunk), config) == 0:
                continue
            # The batch status does not say which key failed; ask key by key.
            failed.extend(key for key in chunk if store.put(key, self._value, config) != 0)
        return failed

    def _replicated(self, replica_num: int) -> Any:
        config = type(self._config)()
        config.replica_num = replica_num
        config.preferred_segment = self.endpoint
        return config

    def withdraw(self, keys: Sequence[str]) -> list[str]:
        """Remove keys; returns those still present afterwards (keys already absent count as removed)."""
        store = self._require_open()
        if not keys:
            return []
        codes = store.batch_remove(list(keys))
        return [key for key, code in zip(keys, codes, strict=True) if code not in (0, OBJECT_NOT_FOUND)]

    def close(self) -> None:
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def __enter__(self) -> MooncakeStorePublisher:
        return self.open()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
        self._executor.shutdown(wait=True)

    # --- async API (same semantics, run on the worker thread) ---

    async def aopen(self) -> MooncakeStorePublisher:
        return await self._run(self.open)

    async def apublish(self, keys: Sequence[str]) -> list[str]:
        return await self._run(self.publish, list(keys))

    async def awithdraw(self, keys: Sequence[str]) -> list[str]:
        return await self._run(self.withdraw, list(keys))

    async def aclose(self) -> None:
        await self._run(self.close)
        self._executor.shutdown(wait=False)

    async def _run(self, func, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, func, *args)

    def _require_open(self) -> Any:
        if self._store is None:
            raise MooncakeStoreError(f"publisher {self.endpoint} is not open")
        return self._store
