"""Admin routes: add, drain and remove instances at run time, behind `Authorization: Bearer <token>`.

With no --admin-token the routes answer 404, as if they did not exist: an open admin API on a
gateway is worse than none. Drain stops new requests to an instance and lets in-flight ones
finish; its answer reports what is still in flight so an operator knows when removal is safe.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

import orjson
from aiohttp import web
from pydantic import ValidationError

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.auth_failures import header_bytes
from kvgate.gateway.errors import APIError, Handler
from kvgate.gateway.fleet.changes import InstanceRefused, add_instance, remove_instance
from kvgate.gateway.fleet.registry import InstanceState, RegistryError, RegistryFull
from kvgate.gateway.protocol import json_response
from kvgate.gateway.state import GATEWAY, Gateway


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/instances", _list)
    app.router.add_post("/admin/instances", _add)
    app.router.add_post("/admin/instances/{id}/drain", _drain)
    app.router.add_delete("/admin/instances/{id}", _remove)


def require_admin(request: web.Request) -> Gateway:
    """The gateway if the request carries the admin token; 404 when admin is off, 401/403 otherwise
    (429 once the client's address spent its failure budget, gateway/auth_failures.py)."""
    gateway = request.app[GATEWAY]
    token = gateway.settings.admin_token
    if not token:
        raise APIError(404, "admin routes are disabled: start the gateway with --admin-token")
    gateway.auth_failures.check(request.remote, "admin")
    scheme, _, presented = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not presented:
        raise APIError(401, "admin routes need 'Authorization: Bearer <admin token>'")
    if not hmac.compare_digest(header_bytes(presented), header_bytes(token)):
        gateway.auth_failures.failed(request.remote, "admin")
        raise APIError(403, "wrong admin token")
    return gateway


def admin_only(handler: Handler) -> Handler:
    """`handler` behind the admin token (--debug-routes admin)."""
    async def guarded(request: web.Request) -> web.StreamResponse:
        require_admin(request)
        return await handler(request)

    return guarded


def _describe(gateway: Gateway, state: InstanceState) -> dict:
    requests, prefill_tokens = gateway.account.inflight(state.id)
    return {**state.describe(), "inflight_requests": requests, "inflight_prefill_tokens": prefill_tokens}


async def _list(request: web.Request) -> web.Response:
    gateway = require_admin(request)
    return json_response({"instances": [_describe(gateway, s) for s in gateway.registry.states()]})


async def _add(request: web.Request) -> web.Response:
    gateway = require_admin(request)
    try:
        config = InstanceConfig.model_validate(orjson.loads(await request.read()))
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "body"
        raise APIError(400, f"invalid instance '{where}': {first['msg']}", param=where) from None
    try:
        state = add_instance(gateway, config)
    except InstanceRefused as exc:
        raise APIError(400, str(exc), param=exc.param, code=exc.code) from None
    except RegistryFull as exc:
        raise APIError(409, str(exc), code="instance_table_full") from None
    except RegistryError as exc:
        raise APIError(409, str(exc), code="instance_exists") from None
    return json_response(_describe(gateway, state), status=201)


async def _drain(request: web.Request) -> web.Response:
    gateway = require_admin(request)
    state = _known(gateway.registry.drain, request)
    return json_response(_describe(gateway, state))


async def _remove(request: web.Request) -> web.Response:
    gateway = require_admin(request)
    state = _known(lambda instance_id: remove_instance(gateway, instance_id), request)
    return json_response(_describe(gateway, state))


def _known(action: Callable[[str], InstanceState], request: web.Request) -> InstanceState:
    """Apply a registry action to the instance named in the path; 404 if there is none."""
    try:
        return action(request.match_info["id"])
    except RegistryError as exc:
        raise APIError(404, str(exc), code="instance_not_found") from None
