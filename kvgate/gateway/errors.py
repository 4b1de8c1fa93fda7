"""OpenAI-style errors, produced in exactly one place: the error middleware.

Handlers raise `APIError` (or let aiohttp raise its HTTP exceptions); the middleware turns every
failure into `{"error": {"message", "type", "param", "code"}}` with the right status, so a client
never sees an HTML page or a bare 500 for something it sent.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

log = logging.getLogger(__name__)

# HTTP status -> OpenAI error type, as OpenAI's own API names them.
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
}


class APIError(Exception):
    """A failure the client should see, with its HTTP status and OpenAI error fields."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers  # e.g. Retry-After on a 429


def error_payload(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    error_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def error_response(error: APIError, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=error.status,
        body=orjson.dumps(error_payload(error.status, error.message, error.param, error.code)),
        content_type="application/json",
        headers=headers if headers is not None else error.headers,
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return error_response(exc)
    except web.HTTPRequestEntityTooLarge:
        limit = request.client_max_size
        return error_response(APIError(413, f"request body too large: the limit is {limit} bytes",
                                       code="body_too_large"))
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        # Routing misses (404, 405) and aiohttp's own refusals, in OpenAI shape.
        message = exc.reason if exc.status != 404 else f"no route {request.method} {request.path}"
        return error_response(APIError(exc.status, message), headers=_kept_headers(exc))
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return error_response(APIError(500, "internal gateway error; see the gateway log", code="internal_error"))


def _kept_headers(exc: web.HTTPException) -> dict[str, str]:
    # 405 must keep its Allow header.
    return {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
