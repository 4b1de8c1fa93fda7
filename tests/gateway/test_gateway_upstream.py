"""The gateway's upstream client (kvgate/gateway/http/upstream.py) against servers on loopback that send
exact bytes: every HTTP/1.1 framing an engine may use, keep-alive reuse and its limits, timeouts,
and broken answers. Each case runs on asyncio's loop and on uvloop (what `kvgate serve` runs)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import uvloop

from kvgate.gateway.http.upstream import Endpoint, UpstreamError, UpstreamPool
from tests.gateway_helpers import closed_port_url

# Request bytes -> what to send back, in order: bytes, b"sleep:S", b"wait-eof" (until the client
# closes), or b"" (close the connection).
Answer = Callable[[bytes], list[bytes]]


class ByteServer:
    """Answers each request with scripted bytes; counts connections and keeps what it received."""

    def __init__(self, answer: Answer) -> None:
        self._answer = answer
        self.connections = 0
        self.hang_ups = 0  # connections the client closed while an answer was awaited ("wait-eof")
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task] = set()
        self.url = ""

    async def __aenter__(self) -> ByteServer:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc_info) -> None:
        assert self._server is not None
        self._server.close()
        for handler in self._handlers:
            handler.cancel()
        await asyncio.gather(*self._handlers, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        handler = asyncio.current_task()
        assert handler is not None
        self._handlers.add(handler)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                               if line.lower().startswith(b"content-length:")), 0)
                request = head + await reader.readexactly(length)
                self.requests.append(request)
                for part in self._answer(request):
                    if part == b"":
                        writer.close()
                        return
                    if part == b"wait-eof":
                        if await reader.read() == b"":
                            self.hang_ups += 1
                        return
                    if part.startswith(b"sleep:"):
                        await asyncio.sleep(float(part[6:]))
                        continue
                    writer.write(part)
                    await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()


def ok(body: bytes = b'{"ok":true}', extra: bytes = b"") -> Answer:
    return lambda request: [b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + extra
                            + b"Content-Length: %d\r\n\r\n" % len(body) + body]


def both_loops(test: Callable[[], Awaitable[None]]) -> Callable[[str], None]:
    """Run an async test body on asyncio's default loop and on uvloop."""

    @pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
    def run(loop: str) -> None:
        (uvloop.run if loop == "uvloop" else asyncio.run)(test())

    run.__name__ = test.__name__
    return run


async def post(pool: UpstreamPool, url: str, body: bytes = b"{}") -> tuple[int, str, bytes]:
    response = await pool.post(url, "/v1/completions", "X-Request-Id: r1\r\n", body)
    try:
        return response.status, response.content_type, await response.read()
    finally:
        response.release()


@both_loops
async def test_content_length_answers_reuse_one_connection():
    async with ByteServer(ok()) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        for _ in range(3):
            assert await post(pool, server.url, b'{"a":1}') == (200, "application/json", b'{"ok":true}')
        assert server.connections == 1 and pool.idle_count() == 1
        first = server.requests[0]
        assert first.startswith(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:")
        assert b"X-Request-Id: r1\r\n" in first and b"Content-Length: 7\r\n" in first
        assert first.endswith(b'\r\n\r\n{"a":1}')
        pool.close()
        assert pool.idle_count() == 0


@both_loops
async def test_chunked_stream_is_read_chunk_by_chunk():
    def stream(request: bytes) -> list[bytes]:
        return [b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                b"Transfer-Encoding: chunked\r\n\r\n",
                b"b\r\ndata: one\n\n\r\n", b"sleep:0.05", b"b\r\ndata: two\n\n\r\n", b"0\r\n\r\n"]

    async with ByteServer(stream) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        response = await pool.post(server.url, "/v1/completions", "", b"{}")
        assert response.media_type == "text/event-stream"
        chunks = []
        while chunk := await response.read_chunk():
            chunks.append(chunk)
        response.release()
        assert chunks == [b"data: one\n\n", b"data: two\n\n"]
        assert pool.idle_count() == 1  # read to its end: reusable


@both_loops
async def test_informational_answer_is_skipped_and_close_delimited_body_is_read_to_the_end():
    def answer(request: bytes) -> list[bytes]:
        return [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n",
                b"until ", b"sleep:0.02", b"the close", b""]

    async with ByteServer(answer) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        assert await post(pool, server.url) == (200, "text/plain", b"until the close")
        assert pool.idle_count() == 0


@both_loops
async def test_connection_close_and_unread_answers_are_not_reused():
    async with ByteServer(ok(extra=b"Connection: close\r\n")) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        await post(pool, server.url)
        await post(pool, server.url)
        assert server.connections == 2 and pool.idle_count() == 0
    async with ByteServer(ok(b"x" * 100)) as server:
        response = await pool.post(server.url, "/v1/completions", "", b"{}")
        response.release()  # body never read: the connection cannot carry another request
        assert pool.idle_count() == 0
        await post(pool, server.url)
        assert server.connections == 2


@both_loops
async def test_truncated_and_invalid_answers_raise_upstream_error():
    truncated = ByteServer(lambda request: [b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nonly this", b""])
    garbage = ByteServer(lambda request: [b"SMTP ready\r\n\r\n"])
    silent_close = ByteServer(lambda request: [b""])
    pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
    async with truncated, garbage, silent_close:
        with pytest.raises(UpstreamError, match="closed the connection before the answer ended"):
            await post(pool, truncated.url)
        with pytest.raises(UpstreamError, match="invalid HTTP answer"):
            await post(pool, garbage.url)
        with pytest.raises(UpstreamError):
            await post(pool, silent_close.url)
    assert pool.idle_count() == 0


@both_loops
async def test_read_timeout_applies_to_the_head_and_between_chunks():
    slow_head = ByteServer(lambda request: [b"sleep:1"])
    slow_body = ByteServer(lambda request: [
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nab\r\n", b"sleep:1", b"0\r\n\r\n"])
    pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=0.2)
    async with slow_head, slow_body:
        with pytest.raises(TimeoutError):
            await post(pool, slow_head.url)
        response = await pool.post(slow_body.url, "/v1/completions", "", b"{}")
        assert await response.read_chunk() == b"ab"
        with pytest.raises(TimeoutError):
            await response.read_chunk()
        response.release()
    assert pool.idle_count() == 0


@both_loops
async def test_refused_connection_raises_os_error():
    pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
    with pytest.raises(OSError):
        await post(pool, closed_port_url())


@both_loops
async def test_idle_connections_are_closed_after_the_idle_limit():
    async with ByteServer(ok()) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        await post(pool, server.url)
        pool.close_idle(older_than_s=60)
        assert pool.idle_count() == 1
        await asyncio.sleep(0.05)
        pool.close_idle(older_than_s=0.01)
        assert pool.idle_count() == 0
        await post(pool, server.url)
        assert server.connections == 2


@both_loops
async def test_cancelled_request_closes_its_connection():
    async with ByteServer(lambda request: [b"wait-eof"]) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=30)
        task = asyncio.create_task(post(pool, server.url))
        while not server.requests:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(_until(lambda: server.hang_ups == 1), 5)  # the engine sees it and can abort
        assert pool.idle_count() == 0


async def _until(predicate: Callable[[], bool]) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_endpoint_parsing():
    assert Endpoint.parse("http://10.0.0.1:8000/") == Endpoint("10.0.0.1", 8000, False, "", "10.0.0.1:8000")
    # The URL's credentials are sent as basic auth, as the health checks send them.
    assert Endpoint.parse("https://user:pw@engine.local/prefix/") == Endpoint(
        "engine.local", 443, True, "/prefix", "engine.local", "Authorization: Basic dXNlcjpwdw==\r\n")
    assert Endpoint.parse("http://[::1]:81").host == "::1"
    with pytest.raises(ValueError):
        Endpoint.parse("ftp://x")


@both_loops
async def test_a_reader_holding_back_a_large_answer_is_not_timed_out():
    body = b"x" * (2 * 1024 * 1024)  # well past the buffer that pauses reading
    async with ByteServer(ok(body)) as server:
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=0.1)
        response = await pool.post(server.url, "/v1/completions", "", b"{}")
        checks = 0
        check_timeout = response._connection._check_timeout

        def counted() -> None:
            nonlocal checks
            checks += 1
            check_timeout()

        response._connection._check_timeout = counted  # type: ignore[method-assign]
        await asyncio.sleep(0.5)  # a slow client: five read timeouts without reading
        assert await response.read() == body
        response.release()
        assert checks < 20  # the timer sleeps while reading is paused, it does not spin
        assert pool.idle_count() == 1


@both_loops
async def test_a_connection_the_engine_closed_while_idle_is_not_reused():
    async with ByteServer(lambda request: [*ok()(request), b""]) as server:  # answer, then close
        pool = UpstreamPool(connect_timeout_s=2, read_timeout_s=5)
        await post(pool, server.url)
        await asyncio.sleep(0.05)  # the close arrives while the connection is idle in the pool
        assert await post(pool, server.url) == (200, "application/json", b'{"ok":true}')
        assert server.connections == 2
