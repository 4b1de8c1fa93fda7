"""An engine that accepts connections and reads requests but never answers (a wedged process)."""

from __future__ import annotations

import asyncio
import contextlib


class HungEngine:
    def __init__(self) -> None:
        self.connections = 0
        self.generations = 0  # POSTs received (health probes are GETs)
        self.open = 0
        self.url = ""
        self._server: asyncio.Server | None = None
        self._writers: list[asyncio.StreamWriter] = []

    async def start(self) -> HungEngine:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self.open += 1
        self._writers.append(writer)
        try:
            while data := await reader.read(65536):  # swallow the request, answer nothing
                self.generations += data.count(b"POST /v1/")
        finally:
            self.open -= 1

    async def close(self) -> None:
        for writer in self._writers:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
