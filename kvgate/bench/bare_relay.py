"""The floor under `kvgate bench overhead --floor`: aiohttp's server relaying to the backend through
kvgate's upstream client, and nothing else.

No middleware, no parsing, no tokenizing, hashing, store lookup or decision, no account and no
metrics. Set up as `kvgate serve` is (uvloop, handler cancellation, no access log, the same
garbage-collector tuning), so its CPU per request is what the gateway's HTTP plumbing costs, and
kvgate's figure minus this one is what routing costs.

Run: python -m kvgate.bench.bare_relay --port P --backend URL
"""

from __future__ import annotations

import argparse
import asyncio

from aiohttp import web

from kvgate.gateway.core import tune_gc
from kvgate.gateway.http.upstream import UpstreamPool

COMPLETIONS = "/v1/completions"
_HEADERS = "Content-Type: application/json\r\nUser-Agent: kvgate\r\n"


def make_app(backend_url: str) -> web.Application:
    pool = UpstreamPool(connect_timeout_s=5.0, read_timeout_s=60.0)

    async def relay(request: web.Request) -> web.StreamResponse:
        upstream = await pool.post(backend_url, COMPLETIONS, _HEADERS, await request.read())
        try:
            body = await upstream.read()
        finally:
            upstream.release()
        return web.Response(status=upstream.status, body=body,
                            headers={"Content-Type": upstream.content_type or "application/json"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": []})

    async def close_pool(app: web.Application) -> None:
        pool.close()

    app = web.Application()
    app.router.add_post(COMPLETIONS, relay)
    app.router.add_get("/v1/models", models)
    app.on_cleanup.append(close_pool)
    return app


async def _serve(port: int, backend_url: str) -> None:
    runner = web.AppRunner(make_app(backend_url), handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
    tune_gc()
    print(f"bare relay listening on http://127.0.0.1:{port}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the backend's base URL")
    args = parser.parse_args()
    try:
        import uvloop
    except ImportError:
        asyncio.run(_serve(args.port, args.backend))
        return
    uvloop.run(_serve(args.port, args.backend))


if __name__ == "__main__":
    main()
