"""What one request learns on its way, noted on the aiohttp request for the parts that report or
end it later (the access log, the shutdown drain), so those need no arguments threaded through
the forwarder and the relay."""

from __future__ import annotations

from aiohttp import web

from kvgate.gateway.planning.routing import RoutePlan

MODEL = web.RequestKey("model", str)  # set by the route handler
PLAN = web.RequestKey("plan", RoutePlan)  # set by the route handler
ANSWERED_BY = web.RequestKey("answered_by", str)  # the forwarder: the instance tried last (PD: the decode)
PREFILLED_BY = web.RequestKey("prefilled_by", str)  # PD: the prefill instance of the pair tried last
# How the request ended when its status does not say it: "shutdown" (drain). A stream the engine
# broke is marked by relay.STREAM_BROKEN.
OUTCOME = web.RequestKey("outcome", str)
# The client's stream once its headers are sent (relay), for the drain to end it with an error event.
STREAMING_RESPONSE = web.RequestKey("streaming_response", web.StreamResponse)
