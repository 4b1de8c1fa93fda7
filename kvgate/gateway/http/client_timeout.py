"""`--client-request-timeout-s`: a request that does not arrive in time is dropped.

aiohttp's server has no header-read timeout of its own, so the two halves of a request are timed
by two mechanisms:
- Headers: the server's keep-alive timer (`keepalive_timeout`, set to the same value by
  `server.start_gateway`). aiohttp (3.14.4 and later; pyproject.toml requires it) arms it when a
  connection opens and again after each answer,
  and on expiry closes the connection if no complete request head has arrived: a client
  trickling its headers, or sending nothing, is cut. A connection idle between requests closes
  after the same time.
- Body: this middleware reads the body before any handler, within the timeout counted from the
  end of the headers; past it the client gets 408 and the connection is closed.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from kvgate.gateway.errors import APIError, Handler, error_response


def body_timeout_middleware(timeout_s: float):
    @web.middleware
    async def read_body_in_time(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.body_exists:
            try:
                if request.content.is_eof():
                    # All of it arrived with the headers (the usual case): nothing to wait for, so no
                    # timer (arming and cancelling one costs ~5 us). Read all the same: a body over
                    # the size limit is refused here whatever the handler does.
                    await request.read()
                else:
                    async with asyncio.timeout(timeout_s):
                        await request.read()  # kept by aiohttp: the handler's read() returns it at once
            except TimeoutError:
                response = error_response(APIError(
                    408, f"the request body was not complete after {timeout_s:g} s", code="request_timeout"))
                response.force_close()
                await response.prepare(request)
                await response.write_eof()
                # Closed now (the answer is flushed first): otherwise aiohttp would keep reading the
                # rest of the body for its lingering time, which is what this timeout refuses.
                request.protocol.force_close()
                return response
        return await handler(request)

    return read_body_in_time
