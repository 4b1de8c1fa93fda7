"""A scripted engine double for fault injection: real HTTP on loopback, behaviour set by a Script.

It answers /v1/completions and /v1/chat/completions like an OpenAI server (whole JSON or SSE),
but can also answer 500 or 400, stream slowly, or drop the connection mid-stream - failures the
real mock engine never produces on purpose. Answers are deterministic (no random ids, no clock),
so a test can compare bytes relayed by the gateway with bytes read directly.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import orjson
from aiohttp import web

from tests.engine_double_helpers import LoopbackEngineServer

MODEL = "scripted-model"


@dataclass
class Script:
    status: int = 200  # anything but 200 answers an OpenAI-style error with this status
    chunks: int = 3  # SSE content chunks of a streamed answer
    delay_s: float = 0.0  # before each chunk
    die_after_chunks: int | None = None  # drop the connection after this many chunks
    health_status: int = 200
    metrics_text: str = ""


@dataclass
class Seen:
    path: str
    headers: dict[str, str]
    body: dict


@dataclass
class ScriptedUpstream(LoopbackEngineServer):
    name: str
    script: Script = field(default_factory=Script)
    seen: list[Seen] = field(default_factory=list)
    cancelled: int = 0  # requests whose client went away before the answer ended
    open_streams: int = 0
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free one

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=self.script.health_status, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.script.metrics_text, content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.seen.append(Seen(request.path, dict(request.headers), body))
        script = self.script
        if script.status != 200:
            error = {"error": {"message": f"{self.name} says {script.status}", "type": "scripted",
                               "param": None, "code": script.status}}
            return web.Response(status=script.status, body=orjson.dumps(error), content_type="application/json")
        chat = request.path.endswith("chat/completions")
        if not body.get("stream"):
            return web.Response(body=orjson.dumps(self._whole(chat)), content_type="application/json")
        return await self._stream(request, chat)

    async def _stream(self, request: web.Request, chat: bool) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        self.open_streams += 1
        try:
            await response.prepare(request)
            for index in range(self.script.chunks):
                if self.script.die_after_chunks is not None and index == self.script.die_after_chunks:
                    assert request.transport is not None
                    request.transport.abort()  # the engine crashed: no terminating chunk
                    return response
                if self.script.delay_s:
                    await asyncio.sleep(self.script.delay_s)
                await response.write(b"data: " + orjson.dumps(self._chunk(chat, index)) + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
            return response
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.open_streams -= 1

    def _text(self, index: int) -> str:
        return f"{self.name}-{index} "

    def _chunk(self, chat: bool, index: int) -> dict:
        last = index == self.script.chunks - 1
        if chat:
            choice = {"index": 0, "delta": {"content": self._text(index)}, "finish_reason": "stop" if last else None}
            return {"id": f"chatcmpl-{self.name}", "object": "chat.completion.chunk", "created": 1,
                    "model": MODEL, "choices": [choice]}
        choice = {"index": 0, "text": self._text(index), "logprobs": None, "finish_reason": "stop" if last else None}
        return {"id": f"cmpl-{self.name}", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [choice]}

    def _whole(self, chat: bool) -> dict:
        text = "".join(self._text(i) for i in range(self.script.chunks))
        usage = {"prompt_tokens": 3, "completion_tokens": self.script.chunks,
                 "total_tokens": 3 + self.script.chunks}
        if chat:
            message = {"role": "assistant", "content": text}
            return {"id": f"chatcmpl-{self.name}", "object": "chat.completion", "created": 1, "model": MODEL,
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}], "usage": usage}
        return {"id": f"cmpl-{self.name}", "object": "text_completion", "created": 1, "model": MODEL,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}],
                "usage": usage}
