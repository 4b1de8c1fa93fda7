"""The access log (`--access-log`): one JSON line per request on the `kvgate.access` logger.

    {"ts": 1790000000.123, "request_id": "...", "method": "POST", "path": "/v1/chat/completions",
     "status": 200, "outcome": "ok", "model": "m", "instance": "e1", "api_key": "team-a",
     "client": "10.0.0.7", "ttft_s": 0.081, "duration_s": 1.92, "prompt_tokens": 3120,
     "prefix_hit_tokens": 2816, "completion_tokens": 64}

`instance` is the instance that answered (for a prefill/decode pair, the decode instance) and
`prefill_instance` the pair's prefill instance (null otherwise, and when the decode prefilled itself).
`outcome` is ok | client_error (4xx) | error (5xx) | client_closed (the client hung up; status 499)
| stream_error (the engine failed after the first byte) | shutdown (ended by the SIGTERM drain).
`ttft_s` is the time to the first byte sent to the client (for a whole answer, to the answer). Fields that are not known for a
request are null: `completion_tokens` comes from the engine's `usage` on whole (non-stream)
answers. When the log is off nothing of this runs.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from dataclasses import dataclass

import orjson
from aiohttp import web

from kvgate.gateway.errors import Handler
from kvgate.gateway.feedback.usage import MAX_REPORTED_TOKENS
from kvgate.gateway.http.auth import CLIENT_KEY
from kvgate.gateway.http.request_notes import ANSWERED_BY, MODEL, OUTCOME, PLAN, PREFILLED_BY
from kvgate.gateway.operations.observe import CLIENT_CLOSED, REQUEST_ID, STREAM_BROKEN

LOGGER_NAME = "kvgate.access"
log = logging.getLogger(LOGGER_NAME)


@dataclass(slots=True)
class _Timing:
    started: float
    first_byte: float | None = None


_TIMING = web.RequestKey("access_timing", _Timing)


def enable(app: web.Application) -> web.Application:
    """Called by build_app when --access-log is on: first-byte times come from the prepare signal."""
    app.on_response_prepare.append(_note_first_byte)
    return app


def configure_logger() -> None:
    """JSON lines alone on stdout (the process log, with its prefixes, stays on stderr)."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("%(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False


async def _note_first_byte(request: web.Request, response: web.StreamResponse) -> None:
    timing = request.get(_TIMING)
    if timing is not None and timing.first_byte is None:
        timing.first_byte = time.perf_counter()


@web.middleware
async def access_log_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Sits inside observe_middleware (which names the request) and outside the error middleware
    (so it sees the status the client got)."""
    timing = request[_TIMING] = _Timing(time.perf_counter())
    try:
        response = await handler(request)
    except asyncio.CancelledError:
        _emit(request, timing, int(CLIENT_CLOSED), "client_closed", None)
        raise
    _emit(request, timing, response.status, _outcome(request, response.status), response)
    return response


def _outcome(request: web.Request, status: int) -> str:
    if OUTCOME in request:
        return request[OUTCOME]
    if STREAM_BROKEN in request:
        return "stream_error"
    if status >= 500:
        return "error"
    return "client_error" if status >= 400 else "ok"


def _emit(request: web.Request, timing: _Timing, status: int, outcome: str,
          response: web.StreamResponse | None) -> None:
    now = time.perf_counter()
    # A whole answer is sent after the handler returns: its first byte leaves now.
    first_byte = timing.first_byte if timing.first_byte is not None or response is None else now
    plan = request.get(PLAN)
    instance = request.get(ANSWERED_BY)
    prefill_instance = request.get(PREFILLED_BY)
    # The hit is the prefix the instance that computed the prompt found (PD: the prefill's).
    computed_by = prefill_instance or instance
    score = plan.score(computed_by) if plan is not None and computed_by is not None else None
    entry = {
        "ts": round(time.time(), 3),
        "request_id": request.get(REQUEST_ID),
        "method": request.method,
        "path": request.path,
        "status": status,
        "outcome": outcome,
        "model": request.get(MODEL),
        "instance": instance,
        "prefill_instance": prefill_instance,
        "api_key": request.get(CLIENT_KEY),
        "client": request.remote,
        "ttft_s": round(first_byte - timing.started, 6) if first_byte is not None else None,
        "duration_s": round(now - timing.started, 6),
        "prompt_tokens": plan.num_prompt_tokens if plan is not None else None,
        "prefix_hit_tokens": score.prefix_hit_tokens if score is not None else None,
        "completion_tokens": _completion_tokens(response),
    }
    log.info("%s", orjson.dumps(entry).decode())


def _completion_tokens(response: web.StreamResponse | None) -> int | None:
    if not isinstance(response, web.Response) or response.status != 200:
        return None
    if response.content_type != "application/json" or not isinstance(response.body, bytes):
        return None
    try:
        tokens = orjson.loads(response.body).get("usage")["completion_tokens"]
    except (orjson.JSONDecodeError, AttributeError, KeyError, TypeError):
        return None
    # The engine's word, logged only when it is a count.
    return tokens if type(tokens) is int and 0 <= tokens <= MAX_REPORTED_TOKENS else None
