"""A lying engine for `kvgate bench soak`: OpenAI-shaped answers with the lies engines were seen to tell.

Every answer reports `usage.prompt_tokens_details.cached_tokens` negative; every other stream ends
(the connection closed cleanly) without its `data: [DONE]`. It passes health checks and serves one
model, so the gateway routes to it like any engine. Run it as
`python -m kvgate.bench.lying_engine --port N --model M`.
"""

from __future__ import annotations

import argparse
import itertools
import time

import orjson
from aiohttp import web

_USAGE = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7,
          "prompt_tokens_details": {"cached_tokens": -1_000_000}}


def build_app(model: str) -> web.Application:
    answered = itertools.count()

    async def generate(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        obj = "chat.completion" if chat else "text_completion"
        choice = ({"index": 0, "message": {"role": "assistant", "content": "lie"}, "finish_reason": "stop"} if chat
                  else {"index": 0, "text": "lie", "finish_reason": "stop"})
        answer = {"id": "cmpl-lie", "object": obj, "created": int(time.time()), "model": model}
        if not body.get("stream"):
            return web.json_response({**answer, "choices": [choice], "usage": _USAGE})
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        delta = ({"index": 0, "delta": {"content": "lie"}, "finish_reason": None} if chat
                 else {"index": 0, "text": "lie", "finish_reason": None})
        for _ in range(2):
            chunk = {**answer, "object": f"{obj}.chunk" if chat else obj, "choices": [delta]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
        await response.write(b"data: " + orjson.dumps({**answer, "choices": [], "usage": _USAGE}) + b"\n\n")
        if next(answered) % 2 == 0:
            await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(_request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def models(_request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": model, "object": "model"}]})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(text="")

    app = web.Application()
    app.router.add_post("/v1/completions", generate)
    app.router.add_post("/v1/chat/completions", generate)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()
    web.run_app(build_app(args.model), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
