"""The gateway's HTTP/1.1 client for engines: pooled keep-alive connections, parsed by llhttp.

Why not aiohttp's client: the gateway sends one kind of request (a POST with a body it already
holds) and relays the answer as bytes. aiohttp's general client (cookies, redirects, auto
decompression, tracing, per-request timeout objects) cost about 0.1 ms of CPU per request, as much
as everything else the gateway does together (measured with `kvgate bench overhead`). Here the
framing (Content-Length, chunked, 1xx, keep-alive) is left to httptools (llhttp, the parser
Node.js uses); this module only pools connections, enforces the timeouts and hands the body over.

Timeouts: `connect_timeout_s` bounds opening a connection; the first-byte timeout (per request)
bounds the wait from sending the request to the first body byte, the part a hung engine never
sends; `read_timeout_s` then bounds each gap between body chunks and is suspended while the relay
holds reading back for a slow client. Until its first body byte a request can also be failed over
by `abort_waiting` (its instance was ejected), as nothing of it has reached the client.

An instance URL's user:password is sent as basic auth with every request (as the health checks
send it), replacing any other Authorization header for that instance.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from typing import cast
from urllib.parse import unquote, urlsplit

import httptools

# Idle connections older than this are closed, not reused: engines' HTTP servers (uvicorn, under
# vLLM and SGLang) drop idle keep-alive connections after 5 s, and a request sent on a connection
# the server is closing fails for nothing.
IDLE_TIMEOUT_S = 4.0
# Body bytes buffered from the engine before reading pauses (the client reads slower than it writes).
_BUFFER_HIGH_WATER = 256 * 1024


class UpstreamError(Exception):
    """The engine could not be reached or its answer broke (closed early, invalid HTTP framing)."""


class FirstByteTimeout(TimeoutError):
    """No body byte came within the first-byte timeout (a hung engine, or one far too busy)."""

    def __init__(self, after_s: float) -> None:
        super().__init__(f"no first byte within {after_s:g} s")
        self.after_s = after_s


@dataclass(frozen=True, slots=True)
class Endpoint:
    """Where an instance URL points, split once: host and port to dial, path prefix, Host header."""

    host: str
    port: int
    tls: bool
    base_path: str
    host_header: str
    # "Authorization: Basic ...\r\n" from the URL's user:password, sent with every request as the
    # health checks (aiohttp) send it; "" without credentials.
    authorization: str = ""

    @classmethod
    def parse(cls, url: str) -> Endpoint:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url!r}")
        tls = parts.scheme == "https"
        port = parts.port or (443 if tls else 80)
        authorization = ""
        if parts.username is not None:
            # Latin-1, as aiohttp encodes the same URL's credentials for the health checks.
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}".encode("latin-1")
            authorization = f"Authorization: Basic {base64.b64encode(pair).decode()}\r\n"
        return cls(parts.hostname, port, tls, parts.path.rstrip("/"), parts.netloc.rpartition("@")[2], authorization)


def url_has_credentials(url: str) -> bool:
    return "@" in url and urlsplit(url).username is not None


class UpstreamResponse:
    """One answer being read. `release()` must follow (a `finally`): it returns the connection to
    the pool when the answer was read to its end, and closes it otherwise, which also tells the
    engine to stop working on the request."""

    __slots__ = ("_connection", "status", "content_type", "content_encoding")

    def __init__(self, connection: _Connection, status: int, content_type: str, content_encoding: str) -> None:
        self._connection = connection
        self.status = status
        self.content_type = content_type  # as sent, parameters included ("" when absent)
        self.content_encoding = content_encoding

    @property
    def media_type(self) -> str:
        return self.content_type.partition(";")[0].strip().lower()

    @property
    def complete(self) -> bool:
        return self._connection.message_complete

    async def read(self) -> bytes:
        """The whole body."""
        parts = []
        while chunk := await self._connection.read_chunk():
            parts.append(chunk)
        return b"".join(parts)

    async def read_chunk(self) -> bytes:
        """The body bytes received since the last call, waiting for some; b"" once the body ended."""
        return await self._connection.read_chunk()

    def release(self) -> None:
        self._connection.finish()


class _Connection(asyncio.Protocol):
    """One keep-alive connection carrying one request at a time."""

    def __init__(self, pool: UpstreamPool, url: str) -> None:
        self._pool = pool
        self.url = url
        self.loop = asyncio.get_running_loop()  # kept: get_running_loop() costs a getpid() call on 3.11
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._read_timeout_s = 0.0
        self._first_byte_timeout_s = 0.0
        self.body_started = False
        # Per-answer state.
        self._busy = False
        self._head: asyncio.Future[UpstreamResponse] | None = None
        self._content_type = b""
        self._content_encoding = b""
        self._framed = False  # Content-Length or Transfer-Encoding given: the body does not end at close
        self.message_complete = False
        self._keep_alive = False
        self._body: list[bytes] = []
        self._buffered = 0
        self._reader: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._paused = False
        self._last_data = 0.0
        self._sent_at = 0.0
        self._timer: asyncio.TimerHandle | None = None

    # --- asyncio.Protocol ---

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports implement asyncio.Transport without subclassing it.
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        if not self._busy:  # bytes nobody asked for: the connection is out of step, drop it
            self._close()
            return
        self._last_data = self.loop.time()
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"invalid HTTP answer: {exc}"))
            self._close()

    def eof_received(self) -> bool:
        self.closed = True  # never handed out again, even before connection_lost runs
        return False  # close our side too

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._busy and not self.message_complete:
            if self._head is None and not self._framed:
                self.message_complete = True  # an HTTP/1.0-style body: it ends where the connection does
                self._wake()
            else:
                self._fail(UpstreamError("the engine closed the connection before the answer ended"))

    def pause_writing(self) -> None:  # a request body larger than the socket buffer: the transport queues it
        pass

    def resume_writing(self) -> None:
        pass

    # --- httptools callbacks ---

    def on_header(self, name: bytes, value: bytes) -> None:
        lowered = name.lower()
        if lowered == b"content-type":
            self._content_type = value
        elif lowered == b"content-encoding":
            self._content_encoding = value
        elif lowered in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        status = self._parser.get_status_code()
        if status < 200:  # 100 Continue and friends precede the real answer
            self._content_type = self._content_encoding = b""
            self._framed = False
            return
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(UpstreamResponse(self, status, self._content_type.decode("latin-1"),
                                             self._content_encoding.decode("latin-1")))

    def on_body(self, body: bytes) -> None:
        self.body_started = True
        self._body.append(body)
        self._buffered += len(body)
        if self._buffered > _BUFFER_HIGH_WATER and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        if self._head is not None:  # the end of a 1xx answer
            return
        self.message_complete = True
        self.body_started = True
        self._keep_alive = self._parser.should_keep_alive()
        self._wake()

    # --- used by the pool and UpstreamResponse ---

    def send(
        self, request: Sequence[bytes], read_timeout_s: float, first_byte_timeout_s: float
    ) -> asyncio.Future[UpstreamResponse]:
        assert self._transport is not None
        self._busy = True
        self.body_started = False
        self._head = self.loop.create_future()
        self._read_timeout_s = read_timeout_s
        self._first_byte_timeout_s = first_byte_timeout_s
        self._last_data = self._sent_at = self.loop.time()
        self._timer = self.loop.call_at(self._sent_at + first_byte_timeout_s, self._check_timeout)
        self._pool.busy(self)
        self._transport.writelines(request)
        return self._head

    async def read_chunk(self) -> bytes:
        while not self._body:
            if self._error is not None:
                raise self._error
            if self.message_complete:
                return b""
            self._reader = self.loop.create_future()
            try:
                await self._reader
            finally:
                self._reader = None
        chunk = b"".join(self._body) if len(self._body) > 1 else self._body[0]
        self._body.clear()
        self._buffered = 0
        if self._paused and self._transport is not None:
            self._paused = False
            self._last_data = self.loop.time()  # the read timeout was suspended meanwhile
            self._transport.resume_reading()
        return chunk

    def finish(self) -> None:
        """End of the exchange: back to the pool if the answer was read whole, closed otherwise."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        reusable = self.message_complete and self._keep_alive and not self._body and not self.closed
        if self._busy:
            self._pool.idle_again(self)
        self._busy = False
        self._head = None
        self._content_type = self._content_encoding = b""
        self._framed = False
        self.message_complete = self._keep_alive = False
        self._body.clear()
        self._buffered = 0
        if reusable:
            self._pool.put(self)
        else:
            self._close()

    # --- internals ---

    def _check_timeout(self) -> None:
        self._timer = None
        if not self._busy or self.message_complete:
            return
        now = self.loop.time()
        if not self.body_started:
            # Head bytes do not restart the first-byte wait: a stream's head comes at once, its
            # first event only after the prefill.
            due = self._sent_at + self._first_byte_timeout_s
            if due > now:
                self._timer = self.loop.call_at(due, self._check_timeout)
                return
            self._fail(FirstByteTimeout(self._first_byte_timeout_s))
            self._close()
            return
        # While paused no bytes can come; resuming restarts the wait (read_chunk sets _last_data).
        due = now + self._read_timeout_s if self._paused else self._last_data + self._read_timeout_s
        if due > now:
            self._timer = self.loop.call_at(due, self._check_timeout)
            return
        self._fail(TimeoutError())
        self._close()

    def abort_if_waiting(self, reason: str) -> None:
        """Fail the request if no body byte has come yet (its caller may retry it elsewhere)."""
        if self._busy and not self.body_started:
            self._fail(UpstreamError(reason))
            self._close()

    def _fail(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(error)
        self._wake()

    def _wake(self) -> None:
        reader = self._reader
        if reader is not None and not reader.done():
            reader.set_result(None)

    def _close(self) -> None:
        self.closed = True
        self._pool.forget(self)
        if self._transport is not None:
            self._transport.close()


class UpstreamPool:
    """Keep-alive connections per endpoint, most recently used first; no cap (engines queue, not us)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._read_timeout_s = read_timeout_s
        self._idle: dict[str, list[_Connection]] = {}  # by instance URL
        self._busy: dict[str, set[_Connection]] = {}  # by instance URL: connections carrying a request
        self._endpoints: dict[str, Endpoint] = {}
        # By instance URL: how many times abort_waiting ran, and its last reason.
        self._aborted: dict[str, tuple[int, str]] = {}
        self._tls: ssl.SSLContext | None = None

    async def post(
        self, url: str, path: str, headers: str, body: bytes, first_byte_timeout_s: float | None = None
    ) -> UpstreamResponse:
        """Send `POST path` to the instance at `url` with `headers` (complete "Name: value\\r\\n" lines)
        and `body`; return once the answer's head arrived. The first body byte must come within
        `first_byte_timeout_s` (default: the read timeout). Raises OSError (connect errors,
        TimeoutError, FirstByteTimeout) or UpstreamError (also for a URL that cannot be dialled)."""
        aborts_before = self._aborted.get(url, (0, ""))[0]
        endpoint = self._endpoints.get(url)
        if endpoint is None:
            endpoint = self._endpoints[url] = _parse_endpoint(url)
        connection = self._idle_connection(url)
        if connection is None:
            connection = await self._connect(url, endpoint)
        if endpoint.authorization:  # the instance's own credentials replace any other
            headers = _without_authorization(headers) + endpoint.authorization
        head = (f"POST {endpoint.base_path}{path} HTTP/1.1\r\nHost: {endpoint.host_header}\r\n{headers}"
                f"Content-Length: {len(body)}\r\n\r\n").encode("utf-8", "surrogateescape")
        waiting = connection.send((head, body), self._read_timeout_s, first_byte_timeout_s or self._read_timeout_s)
        aborted = self._aborted.get(url)
        if aborted is not None and aborted[0] != aborts_before:
            # The instance was ejected while this request was connecting, before abort_waiting could see it.
            connection.abort_if_waiting(aborted[1])
        try:
            return await waiting
        except BaseException:
            connection.finish()  # closes it: the answer was not read
            raise

    def put(self, connection: _Connection) -> None:
        connection.idle_since = connection.loop.time()
        self._idle.setdefault(connection.url, []).append(connection)

    def busy(self, connection: _Connection) -> None:
        self._busy.setdefault(connection.url, set()).add(connection)

    def idle_again(self, connection: _Connection) -> None:
        busy = self._busy.get(connection.url)
        if busy is not None:
            busy.discard(connection)
            if not busy:
                del self._busy[connection.url]

    def abort_waiting(self, url: str, reason: str) -> int:
        """Fail the requests to `url` that have received no body byte yet (their instance was
        ejected): nothing reached their clients, so their callers retry them elsewhere. Returns
        how many were failed."""
        self._aborted[url] = (self._aborted.get(url, (0, ""))[0] + 1, reason)
        waiting = [c for c in self._busy.get(url, ()) if not c.body_started]
        for connection in waiting:
            connection.abort_if_waiting(reason)
        return len(waiting)

    def forget(self, connection: _Connection) -> None:
        idle = self._idle.get(connection.url)
        if idle and connection in idle:
            idle.remove(connection)

    def close_idle(self, older_than_s: float = IDLE_TIMEOUT_S) -> None:
        """Close connections idle longer than `older_than_s`."""
        oldest = asyncio.get_running_loop().time() - older_than_s
        for idle in list(self._idle.values()):
            for connection in [c for c in idle if c.idle_since <= oldest]:
                connection.finish()  # not busy and nothing read: closes it, and forget() unlists it

    def close(self) -> None:
        """Close every idle connection (at shutdown; busy ones close as their requests end)."""
        self.close_idle(older_than_s=-1.0)

    def idle_count(self) -> int:
        return sum(len(idle) for idle in self._idle.values())

    def _idle_connection(self, url: str) -> _Connection | None:
        idle = self._idle.get(url)
        if not idle:
            return None
        fresh_after = idle[-1].loop.time() - IDLE_TIMEOUT_S
        while idle:
            connection = idle.pop()
            if not connection.closed and connection.idle_since > fresh_after:
                return connection
            connection.finish()
        return None

    async def _connect(self, url: str, endpoint: Endpoint) -> _Connection:
        loop = asyncio.get_running_loop()
        tls = None
        if endpoint.tls:
            if self._tls is None:
                self._tls = ssl.create_default_context()
            tls = self._tls
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, connection = await loop.create_connection(
                    lambda: _Connection(self, url), endpoint.host, endpoint.port, ssl=tls,
                    server_hostname=endpoint.host if tls else None,
                )
        except (ValueError, OverflowError) as exc:  # a host or port the socket layer refuses
            raise UpstreamError(f"cannot connect to {url!r}: {exc}") from None
        return connection


def _without_authorization(headers: str) -> str:
    return "".join(line + "\r\n" for line in headers.split("\r\n")
                   if line and not line.lower().startswith("authorization:"))


def _parse_endpoint(url: str) -> Endpoint:
    try:
        return Endpoint.parse(url)
    except ValueError as exc:  # an out-of-range port, an empty host: unreachable, like a refused connection
        raise UpstreamError(f"cannot dial {url!r}: {exc}") from None
