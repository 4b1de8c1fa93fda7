"""An engine double whose every answer the test writes: real HTTP on loopback, any bytes.

The scripted upstream (scripted_upstream.py) answers well-formed OpenAI answers with faults on top;
this one answers whatever `answer` returns (impossible usage numbers, endless SSE events, streams
without `data: [DONE]`, odd kv_transfer_params), to test what the gateway does with an engine it
cannot trust.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import ClassVar

import orjson
from aiohttp import web

from tests.engine_double_helpers import LoopbackEngineServer

MODEL = "double-model"

Answer = Callable[[web.Request, dict], Awaitable[web.StreamResponse]]


def completion(usage: object = None, text: str = "ok", **extra: object) -> dict:
    answer = {"id": "cmpl-double", "object": "text_completion", "created": 1, "model": MODEL,
              "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": "stop"}], **extra}
    if usage is not None:
        answer["usage"] = usage
    return answer


def chunk(text: str = "t", usage: object = None, choices: bool = True) -> bytes:
    body: dict = {"id": "cmpl-double", "object": "text_completion", "created": 1, "model": MODEL,
                  "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": None}] if choices else []}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + orjson.dumps(body) + b"\n\n"


async def whole(body: dict | bytes, status: int = 200) -> web.Response:
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return web.Response(status=status, body=data, content_type="application/json")


async def stream(request: web.Request, pieces: list[bytes]) -> web.StreamResponse:
    """`pieces` written one by one (each may hold part of an event, or several), then the body ends."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for piece in pieces:
        await response.write(piece)
    await response.write_eof()
    return response


async def default_answer(request: web.Request, body: dict) -> web.StreamResponse:
    if body.get("stream"):
        return await stream(request, [chunk("a"), chunk("b"), b"data: [DONE]\n\n"])
    return await whole(completion({"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}))


@dataclass
class EngineDouble(LoopbackEngineServer):
    answer: Answer = default_answer
    metrics_text: str = "vllm:num_requests_running 0\nvllm:num_requests_waiting 0\n"
    # Only requests with this Authorization header are served (401 otherwise), /health included.
    required_authorization: str | None = None
    seen: list[tuple[dict[str, str], dict]] = field(default_factory=list)
    max_body_bytes: ClassVar[int] = 64 * 1024 * 1024

    def _refused(self, request: web.Request) -> bool:
        return self.required_authorization is not None and \
            request.headers.get("Authorization") != self.required_authorization

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=401 if self._refused(request) else 200, text="ok")

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(text=self.metrics_text, content_type="text/plain")

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        self.seen.append((dict(request.headers), body))
        if self._refused(request):
            error = {"error": {"message": "wrong credentials", "type": "authentication_error", "param": None,
                               "code": None}}
            return await whole(error, status=401)
        return await self.answer(request, body)
