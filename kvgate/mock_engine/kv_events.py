"""A mock engine's KV events publisher, on vLLM's ZMQ wire (REFERENCE.md section 13).

A PUB socket sends each batch as three frames: the topic, the batch's sequence number (8 bytes,
big-endian, from 0, one per batch, so a restarted engine starts again at 0) and the msgpack
payload (kv_event_wire). As vLLM's publisher, it binds when the endpoint has `*`, `::`, ipc or
inproc, and connects otherwise (the subscriber then binds). The last `buffer_batches` batches are
kept for an optional replay ROUTER: a DEALER that sends `["", start_seq]` gets every kept batch
from start_seq as `["", topic, seq, payload]`, then `["", "", seq -1, ""]` to end.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq
import zmq.asyncio

from kvgate.mock_engine.kv_event_wire import (
    EVENT_ENCODINGS,
    HASH_FORMATS,
    EventEncoding,
    HashFormat,
    KVEvent,
    encode_batch,
)

logger = logging.getLogger(__name__)

DEFAULT_TOPIC = "kv-events"
# vLLM's replay buffer (its buffer_steps default).
DEFAULT_BUFFER_BATCHES = 10_000
_END_SEQ = (-1).to_bytes(8, "big", signed=True)
_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass(frozen=True)
class KVEventsOptions:
    endpoint: str
    replay_endpoint: str | None = None
    topic: str = DEFAULT_TOPIC
    encoding: EventEncoding = "map"
    hash_format: HashFormat = "int"
    buffer_batches: int = DEFAULT_BUFFER_BATCHES

    def __post_init__(self) -> None:
        for name, endpoint in (("endpoint", self.endpoint), ("replay endpoint", self.replay_endpoint)):
            if endpoint is not None and not endpoint.startswith(_SCHEMES):
                raise ValueError(
                    f"KV events {name} {endpoint!r}: must start with tcp://, ipc:// or inproc://"
                )
        if self.encoding not in EVENT_ENCODINGS:
            raise ValueError(
                f"KV events encoding {self.encoding!r}: choose from {', '.join(EVENT_ENCODINGS)}"
            )
        if self.hash_format not in HASH_FORMATS:
            raise ValueError(f"KV events hash {self.hash_format!r}: choose from {', '.join(HASH_FORMATS)}")
        if self.buffer_batches < 1:
            raise ValueError("KV events replay buffer must hold at least 1 batch")


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard or IPv6 any-address, ipc and inproc bind; an explicit address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventsPublisher:
    def __init__(self, options: KVEventsOptions) -> None:
        self.options = options
        self._topic = options.topic.encode()
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=options.buffer_batches)
        self._ctx = zmq.Context()
        self._pub: zmq.Socket | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._closed = False
        self.endpoint = options.endpoint
        self.replay_endpoint = options.replay_endpoint

    def start(self) -> None:
        """Open the sockets (raises zmq.ZMQError if an address is taken) and serve replays."""
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.LINGER, 0)
            if binds(self.options.endpoint):
                self.endpoint = _bind(self._pub, self.options.endpoint)
            else:
                self._pub.connect(self.options.endpoint)
            if self.options.replay_endpoint is not None:
                self._replay = zmq.asyncio.Context.shadow(self._ctx).socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # As vLLM, the replay socket always binds: clients come to the engine.
                self.replay_endpoint = _bind(self._replay, self.options.replay_endpoint)
                loop = asyncio.get_running_loop()
                self._replay_task = loop.create_task(self._serve_replays(), name="kv-replay")
        except BaseException:
            self._close_sockets()
            raise

    @property
    def next_seq(self) -> int:
        return self._next_seq

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Send one batch (nothing for no events). Never blocks: PUB drops what a slow subscriber
        cannot take, which the subscriber sees as a gap in the sequence and repairs by replay."""
        if not events or self._pub is None:
            return
        seq = self._next_seq
        self._next_seq += 1
        payload = encode_batch(time.time(), events, self.options.encoding)
        self._buffer.append((seq, payload))
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)

    async def close(self) -> None:
        if self._replay_task is not None:
            self._replay_task.cancel()
            await asyncio.gather(self._replay_task, return_exceptions=True)
            self._replay_task = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._closed:
            return
        self._closed = True
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()

    async def _serve_replays(self) -> None:
        assert self._replay is not None
        replay = self._replay
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events replay: ignoring a malformed request of %d frame(s)", len(frames))
                continue
            client, _, start = frames
            start_seq = int.from_bytes(start, "big")
            # A snapshot: batches published while answering go out live, not twice.
            for seq, payload in list(self._buffer):
                if seq >= start_seq:
                    await replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await replay.send_multipart((client, b"", b"", _END_SEQ, b""))


def _bind(sock: zmq.Socket, endpoint: str) -> str:
    """Bind and return the bound address (port 0 means any free port, given back resolved)."""
    sock.bind(endpoint)
    return sock.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
