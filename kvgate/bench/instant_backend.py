"""A backend that answers every completion at once: the floor for router-overhead measurements.

What a router adds is (latency through it) - (latency to its backend), at equal load. Behind a
simulated engine the difference drowns in the engine's own work and the engine caps the request
rate long before a router does, so the overhead phase of `kvgate bench routers` talks to these
instead: they read and parse the request like an engine, answer a one-token completion with
usage (as whole JSON, or streamed when the request asks: the token event, then `data: [DONE]`),
serve /health, /v1/models and idle /metrics (what routers probe), and nothing else.

Run: python -m kvgate.bench.instant_backend --port P --model M
"""

from __future__ import annotations

import argparse
import time

import orjson
from aiohttp import web


def make_app(model: str) -> web.Application:
    created = int(time.time())
    models = orjson.dumps({"object": "list", "data": [
        {"id": model, "object": "model", "created": created, "owned_by": "kvgate"}]})
    # An idle vLLM's gauges, for gateways that scrape engine load.
    idle_metrics = "".join(
        f'vllm:{name}{{model_name="{model}"}} 0.0\n'
        for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
    )

    async def completions(request: web.Request) -> web.StreamResponse:
        try:
            body = orjson.loads(await request.read())
        except orjson.JSONDecodeError:
            return web.json_response({"error": {"message": "body is not JSON", "type": "invalid_request_error",
                                                "code": 400}}, status=400)
        if not isinstance(body, dict):
            body = {}
        if body.get("stream") is True:
            return await stream(request)
        prompt = body.get("prompt")
        # Roughly a token per four characters; the figure only has to look like an engine's.
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(str(prompt or "")) // 4
        answer = {
            "id": "cmpl-instant", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": 1,
                      "total_tokens": prompt_tokens + 1, "prompt_tokens_details": {"cached_tokens": 0}},
        }
        return web.Response(body=orjson.dumps(answer), content_type="application/json")

    async def stream(request: web.Request) -> web.StreamResponse:
        # Two writes, as an engine sends the token and the end of the stream separately.
        event = {
            "id": "cmpl-instant", "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": " ok", "logprobs": None, "finish_reason": "length"}],
        }
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        await response.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def list_models(request: web.Request) -> web.Response:
        return web.Response(body=models, content_type="application/json")

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(text=idle_metrics, content_type="text/plain")

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/metrics", metrics)
    return app


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True, help="served model name")
    args = parser.parse_args(argv)
    try:
        import uvloop
    except ImportError:
        loop = None
    else:
        loop = uvloop.new_event_loop()
    web.run_app(make_app(args.model), host="127.0.0.1", port=args.port, access_log=None, print=None, loop=loop)


if __name__ == "__main__":
    main()
