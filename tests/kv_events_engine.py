"""An engine's KV events sockets as vLLM 0.32 runs them, for tests: real ZMQ over loopback.

The PUB socket binds (as vLLM does for tcp://*:PORT) and sends [topic, seq as 8 big-endian bytes,
payload]; the ROUTER socket answers a replay request [identity, "", start seq] with each buffered
batch from that seq, [identity, "", topic, seq, payload], then [identity, "", "", seq -1, ""].

Payloads are built with msgpack here, field by field, as vLLM's msgspec encoder lays out
KVEventBatch (an array: ts, events, data_parallel_rank) and its events: maps tagged by "type" with
defaulted trailing fields left out (`encoding="map"`, vLLM 0.32) or arrays led by the type
(`encoding="array"`, before vLLM PR #42892). They are written independently of kvgate's decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.kvs_client.events.keys import engine_block_hashes
from kvgate.scheduler.hashing import BlockExtras

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def stored(hashes: list, parent: Any, token_ids: list[int], block_size: int, *, medium: str | None = "GPU",
           lora_name: str | None = None, extra_keys: list | None = None, group_idx: int | None = None,
           encoding: str = "map") -> Any:
    if encoding == "array":
        event = ["BlockStored", hashes, parent, token_ids, block_size, None, medium, lora_name]
        if extra_keys is not None or group_idx is not None:
            event += [extra_keys, group_idx]
        return event
    event = {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
             "block_size": block_size, "lora_id": None, "medium": medium, "lora_name": lora_name}
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    if group_idx is not None:
        event["group_idx"] = group_idx
    return event


def removed(hashes: list, *, medium: str | None = "GPU", encoding: str = "map") -> Any:
    if encoding == "array":
        return ["BlockRemoved", hashes, medium]
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def cleared(encoding: str = "map") -> Any:
    return ["AllBlocksCleared"] if encoding == "array" else {"type": "AllBlocksCleared"}


def batch_payload(events: list, ts: float | None = None) -> bytes:
    return msgpack.packb([time.time() if ts is None else ts, events, 0])


class FakeEventsEngine:
    """The sockets of one engine's KV events publisher (call `start`, then `publish`)."""

    def __init__(self, *, topic: str = "kv-events", encoding: str = "map", int_hashes: bool = True,
                 replay: bool = True, block_size: int = 16) -> None:
        self.topic = topic.encode()
        self.encoding = encoding
        self.int_hashes = int_hashes
        self.block_size = block_size
        self._replay_wanted = replay
        self._context = zmq.asyncio.Context()
        self._seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        self.connections = 0  # subscribers connected to the PUB socket now
        self.accepted = 0  # connections ever accepted
        self.replay_requests: list[int] = []
        self._tasks: list[asyncio.Task] = []
        self.endpoint = self.replay_endpoint = ""

    async def start(self, port: int = 0, replay_port: int = 0) -> FakeEventsEngine:
        self._pub = self._context.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        monitor = self._pub.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.endpoint = self._bind(self._pub, port)
        self._tasks.append(asyncio.create_task(self._watch(monitor)))
        if self._replay_wanted:
            self._router = self._context.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            self.replay_endpoint = self._bind(self._router, replay_port)
            self._tasks.append(asyncio.create_task(self._serve_replay()))
        return self

    @staticmethod
    def _bind(socket: zmq.asyncio.Socket, port: int) -> str:
        if port:
            socket.bind(f"tcp://127.0.0.1:{port}")
        else:
            socket.bind("tcp://127.0.0.1:*")
        return socket.getsockopt(zmq.LAST_ENDPOINT).decode()

    @property
    def port(self) -> int:
        return int(self.endpoint.rsplit(":", 1)[1])

    @property
    def replay_port(self) -> int:
        return int(self.replay_endpoint.rsplit(":", 1)[1])

    async def wait_subscribed(self, count: int = 1, timeout_s: float = 10.0) -> None:
        """Until `count` subscribers are connected (and their subscriptions had time to arrive)."""
        deadline = time.monotonic() + timeout_s
        while self.connections < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.connections} subscriber(s) connected, expected {count}")
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)

    def hashes(self, token_ids: list[int], seed: str = "0", extras: BlockExtras | None = None) -> list:
        return engine_block_hashes(token_ids, self.block_size, seed, as_bytes=not self.int_hashes, extras=extras)

    def store_prompt(self, token_ids: list[int], medium: str = "GPU", parent: Any = None, skip: int = 0,
                     extras: BlockExtras | None = None) -> list:
        """A BlockStored event for the prompt's full blocks from block `skip` on (as one event), of a
        request with `extras` (its LoRA adapter, its cache salt) listed untagged as vLLM does."""
        hashes = self.hashes(token_ids, extras=extras)
        if skip:
            parent = hashes[skip - 1]
        blocks = hashes[skip:]
        tokens = token_ids[skip * self.block_size : (skip + len(blocks)) * self.block_size]
        lora_name, extra_keys = None, None
        if extras:
            lora_name = extras.lora[0] if extras.lora else None
            extra_keys = [[key[1] for key in extras.keys(skip + i == 0) or []] or None for i in range(len(blocks))]
        return stored(blocks, parent, tokens, self.block_size, medium=medium, encoding=self.encoding,
                      lora_name=lora_name, extra_keys=extra_keys)

    async def publish(self, events: list, *, seq: int | None = None, payload: bytes | None = None,
                      send: bool = True) -> int:
        """One batch under the next sequence number (or `seq`); `send=False` buffers it for replay only
        (a batch the subscriber misses)."""
        number = self._seq if seq is None else seq
        self._seq = number + 1
        data = batch_payload(events) if payload is None else payload
        self.buffer.append((number, data))
        if send:
            await self._pub.send_multipart([self.topic, number.to_bytes(8, "big"), data])
        return number

    def restart_numbering(self) -> None:
        """What an engine restart does to the sequence (its replay buffer starts empty too)."""
        self._seq = 0
        self.buffer.clear()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.disable_monitor()
        self._context.destroy(linger=0)

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            if event["event"] == zmq.EVENT_ACCEPTED:
                self.connections += 1
                self.accepted += 1
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self.connections -= 1

    async def _serve_replay(self) -> None:
        while True:
            identity, _, start = await self._router.recv_multipart()
            first = int.from_bytes(start, "big")
            self.replay_requests.append(first)
            for seq, data in list(self.buffer):
                if seq >= first:
                    await self._router.send_multipart([identity, b"", self.topic, seq.to_bytes(8, "big"), data])
            await self._router.send_multipart([identity, b"", b"", END_SEQ, b""])
