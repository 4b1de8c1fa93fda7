"""Read an HTTP store answer only up to --kvs-max-answer-bytes.

Parsing megabytes of JSON costs every request tens of milliseconds of the event loop, and the
store is advice, not a dependency: a longer answer fails the lookup unread (KVSAnswerTooLarge).
"""

from __future__ import annotations

import aiohttp

from kvgate.kvs_client.base import KVSAnswerTooLarge


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
