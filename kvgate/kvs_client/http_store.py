"""What the backends that ask a store over HTTP share (Mooncake master, Conductor indexer): one
lazily opened client session per backend, and one call that reads a JSON answer only up to
--kvs-max-answer-bytes and turns every failure into KVSQueryError.

Parsing megabytes of JSON costs every request tens of milliseconds of the event loop, and the
store is advice, not a dependency: a longer answer fails the lookup unread (KVSAnswerTooLarge).
"""

from __future__ import annotations

from typing import Any

import aiohttp
import orjson
from yarl import URL

from kvgate.kvs_client.base import KVSAnswerTooLarge, KVSQueryError


class StoreSession:
    """An aiohttp session opened on first use (backends are built before the event loop runs)."""

    def __init__(self, *, max_connections: int, request_timeout_s: float) -> None:
        self._max_connections = max_connections
        self._timeout = aiohttp.ClientTimeout(total=request_timeout_s)
        self._session: aiohttp.ClientSession | None = None

    def get(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=self._timeout,
                raise_for_status=False,
            )
        return self._session

    async def close(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            await session.close()

    async def json(self, method: str, url: str | URL, what: str, max_bytes: int, **kwargs: Any) -> Any:
        """The decoded JSON answer of `method url` (kwargs go to aiohttp), or KVSQueryError for a
        transport failure, a status other than 200, an answer over `max_bytes` or invalid JSON.
        `what` names the call in errors ("GET http://master:9003/batch_query_keys")."""
        try:
            async with self.get().request(method, url, **kwargs) as response:
                body = await read_bounded(response, max_bytes, what)
                status = response.status
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise KVSQueryError(f"{what}: {type(exc).__name__}: {exc}") from exc
        if status != 200:
            raise KVSQueryError(f"{what}: HTTP {status}: {body[:200]!r}")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise KVSQueryError(f"{what}: invalid JSON: {exc}") from exc


async def read_bounded(response: aiohttp.ClientResponse, limit: int, what: str) -> bytes:
    """The body of `response`, or KVSAnswerTooLarge once it passes `limit` bytes. `what` names
    the call in the error ("GET http://master:9003/batch_query_keys")."""
    too_large = KVSAnswerTooLarge(f"{what}: answer longer than {limit} bytes (--kvs-max-answer-bytes)")
    if response.content_length is not None and response.content_length > limit:
        raise too_large
    body = bytearray()
    async for chunk in response.content.iter_any():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)
