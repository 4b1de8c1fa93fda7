"""POST /debug/schedule: what the gateway would do with this body, without doing it.

Same body as /v1/completions or /v1/chat/completions (told apart by `messages`). The answer is
the real plan (tokenize, hash, KV store lookup, decision) but nothing is forwarded and the load
account is not touched, so it is safe to call against a production gateway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from kvgate.gateway.admission import predicted_ttft_s
from kvgate.gateway.errors import APIError, Handler
from kvgate.gateway.observe import REQUEST_ID
from kvgate.gateway.protocol import json_response, parse_chat, parse_completion
from kvgate.gateway.routing import RoutePlan
from kvgate.gateway.state import GATEWAY


def add_routes(app: web.Application, guard: Callable[[Handler], Handler] | None = None) -> None:
    """`guard` wraps the handler (the admin-token check of --debug-routes admin)."""
    app.router.add_post("/debug/schedule", guard(_schedule) if guard else _schedule)


async def _schedule(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    raw = await request.read()
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    is_chat = isinstance(body, dict) and "messages" in body
    parsed = (parse_chat if is_chat else parse_completion)(raw)
    plan = await gateway.planner.plan(parsed, explain=True)
    rate = gateway.settings.prefill_tokens_per_s
    return json_response({
        **_pd_fields(plan),
        # The X-Request-Id of this call (the client's own, or the one the gateway gave it).
        "request_id": request[REQUEST_ID],
        "selected": plan.decision.selected,
        "ranking": list(plan.decision.ranking),
        "cache_aware": plan.decision.cache_aware,
        "policy": gateway.settings.effective_policy.value,
        "num_prompt_tokens": plan.num_prompt_tokens,
        "block_keys": plan.block_keys,
        "kvs_status": plan.kvs_status,
        "kvs_elapsed_ms": round(plan.kvs_elapsed_s * 1000, 3),
        "instances": [
            {
                "id": score.id,
                "prefix_hit_tokens": score.prefix_hit_tokens,
                "prefix_miss_tokens": score.prefix_miss_tokens,
                "metrics": score.metrics,
                "predicted_ttft_s": round(predicted_ttft_s(plan, score.id, rate), 6),
            }
            for score in plan.decision.scores
        ],
    })


def _pd_fields(plan: RoutePlan) -> dict[str, Any]:
    """A disaggregated request's two choices, each with its ranking and scores (docs/PD.md)."""
    if plan.pd is None:
        return {}
    return {
        "pd": True,
        "skip_prefill": plan.pd.skip_prefill,
        "decode_miss_tokens": plan.pd.decode_miss_tokens,
        **{
            half: {
                "selected": decision.selected,
                "ranking": list(decision.ranking),
                "instances": [{"id": s.id, "prefix_hit_tokens": s.prefix_hit_tokens, "metrics": s.metrics}
                              for s in decision.scores],
            }
            for half, decision in (("prefill", plan.pd.prefill), ("decode", plan.pd.decode))
        },
    }
