"""What the engine doubles (engine_double.py, scripted_upstream.py) share: an engine's HTTP routes served on
a loopback port."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Self

from aiohttp import web


class LoopbackEngineServer(ABC):
    """Serves `_generate` on the OpenAI completion routes, and `_health` and `_metrics`, until `close`."""

    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one
    max_body_bytes: ClassVar[int] = 1024 * 1024  # aiohttp's default
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> Self:
        app = web.Application(client_max_size=self.max_body_bytes)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.host, self.port).start()
        self.url = f"http://{self.host}:{self._runner.addresses[0][1]}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    @abstractmethod
    async def _generate(self, request: web.Request) -> web.StreamResponse: ...

    @abstractmethod
    async def _health(self, request: web.Request) -> web.Response: ...

    @abstractmethod
    async def _metrics(self, request: web.Request) -> web.Response: ...
