"""POST /debug/schedule: what the gateway would do with this body, without doing it.

Same body as /v1/completions or /v1/chat/completions (told apart by `messages`). The answer is
the real plan (tokenize, hash, KV store lookup, decision) but nothing is forwarded and the load
account is not touched, so it is safe to call against a production gateway. It tokenizes the
whole prompt, which takes the CPU live requests need: at most `--debug-max-concurrent` calls run at
once, the others get 429 (with API keys configured the route is behind the admin token by default).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson
from aiohttp import web

from kvgate.gateway.errors import APIError, Handler
from kvgate.gateway.feedback.prfaas import PrfaasLink
from kvgate.gateway.operations.observe import REQUEST_ID
from kvgate.gateway.planning.routing import RoutePlan
from kvgate.gateway.protocol import json_response, parse_chat, parse_completion
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client.events.view import EventsView
from kvgate.scheduler.types import TTFTPrediction


def add_routes(app: web.Application, max_concurrent: int,
               guard: Callable[[Handler], Handler] | None = None) -> None:
    """`guard` wraps the handler (the admin-token check of --debug-routes admin)."""
    running = 0

    async def schedule(request: web.Request) -> web.Response:
        nonlocal running
        if running >= max_concurrent:
            raise APIError(429, f"/debug/schedule is already planning {running} prompt(s) "
                           "(--debug-max-concurrent); retry later", code="debug_busy", headers={"Retry-After": "1"})
        running += 1
        try:
            return await _schedule(request)
        finally:
            running -= 1

    app.router.add_post("/debug/schedule", guard(schedule) if guard else schedule)


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
    states = {} if gateway.events is None else {i: state.name.lower() for i, state in gateway.events.states().items()}
    rejection = gateway.scheduler.judge(plan.decision, plan.candidates, plan.decode_load)
    return json_response({
        **_pd_fields(plan),
        **_prfaas_fields(plan, gateway.prfaas),
        # The X-Request-Id of this call (the client's own, or the one the gateway gave it).
        "request_id": request[REQUEST_ID],
        "selected": plan.decision.selected,
        "ranking": list(plan.decision.ranking),
        "cache_aware": plan.decision.cache_aware,
        "policy": gateway.settings.effective_policy,
        "num_prompt_tokens": plan.num_prompt_tokens,
        # True: num_prompt_tokens is an estimate and block_keys cover the prompt's leading part
        # only (--tokenize-tail estimate; every block past them is held nowhere).
        "prompt_tokens_estimated": plan.prompt_tokens_estimated,
        "block_keys": plan.block_keys,
        "kvs_status": plan.kvs_status,
        "kvs_elapsed_ms": round(plan.kvs_elapsed_s * 1000, 3),
        # off: no events index; unavailable: not asked (a cache_salt) or too busy to read.
        "events_status": "off" if gateway.events is None else "ok" if plan.engine_hits is not None else "unavailable",
        "early_rejection": gateway.settings.early_rejection.value,
        "rejection": None if rejection is None else {
            "code": rejection.code, "message": rejection.message, "retry_after_s": rejection.retry_after_s,
        },
        "instances": [
            {
                "id": score.id,
                "prefix_hit_tokens": score.prefix_hit_tokens,
                "prefix_miss_tokens": score.prefix_miss_tokens,
                "metrics": score.metrics,
                **_hit_sources(plan, score.id, gateway.kvs is not None, gateway.events, states),
                **_prediction_fields(plan.prediction(score.id)),
            }
            for score in plan.decision.scores
        ],
    })


def _hit_sources(plan: RoutePlan, instance_id: str, has_store: bool, events: EventsView | None,
                 states: dict[str, str]) -> dict[str, Any]:
    """Where the instance's prefix hit came from: its own store segment (`store_hit_tokens`, None
    without a store) and its engine's KV events (`events`, None without an events index), and which
    of the two gave `prefix_hit_tokens`, the longer (`hit_source`: store, events, both when equal,
    None for no hit)."""
    store = (plan.store_hits or {}).get(instance_id, 0) if has_store else None
    engine = None
    if events is not None:
        hits = plan.engine_hits
        prefix = hits.prefixes.get(instance_id) if hits is not None else None
        engine = {
            # synced | partial | silent (its cache is unknown) | not_followed (no endpoint or slot)
            "state": states.get(instance_id, "not_followed"),
            "tokens": prefix.tokens if prefix else 0,
            "gpu_tokens": prefix.gpu_tokens if prefix else 0,
            "cpu_tokens": prefix.cpu_tokens if prefix else 0,
            "disk_tokens": prefix.disk_tokens if prefix else 0,
        }
    store_tokens, engine_tokens = store or 0, engine["tokens"] if engine else 0
    source = (None if not (store_tokens or engine_tokens) else "both" if store_tokens == engine_tokens
              else "store" if store_tokens > engine_tokens else "events")
    return {"hit_source": source, "store_hit_tokens": store, "events": engine}


def _prediction_fields(prediction: TTFTPrediction | None) -> dict[str, float | int | None]:
    """The TTFT model's terms for one instance (calibrated; they sum to predicted_ttft_s)."""
    if prediction is None:
        return dict.fromkeys(("predicted_ttft_s", "queue_s", "prefill_s", "transfer_s", "transfer_tokens",
                              "local_hit_tokens"))
    return {
        "predicted_ttft_s": round(prediction.predicted_ttft_s, 6),
        "queue_s": round(prediction.queue_s, 6),
        "prefill_s": round(prediction.prefill_s, 6),
        "transfer_s": round(prediction.transfer_s, 6),
        "transfer_tokens": prediction.transfer_tokens,
        "local_hit_tokens": prediction.local_hit_tokens,
    }


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


def _prfaas_fields(plan: RoutePlan, link: PrfaasLink | None) -> dict[str, Any]:
    """Which cluster prefills and why (scheduler/prfaas.py), beside the rule's running state."""
    if plan.pd is None or plan.pd.cluster is None or link is None:
        return {}
    cluster = plan.pd.cluster
    return {"prfaas": {
        "cluster": cluster.cluster,
        "offloaded": cluster.offloaded,
        "reason": cluster.reason,
        "mode": cluster.mode.value,
        "threshold_tokens": cluster.threshold_tokens,
        "incremental_tokens": cluster.incremental_tokens,
        "prefix_tokens": cluster.prefix_tokens,
        "prefix_cluster": cluster.prefix_cluster,
        "shipped_prefix_tokens": cluster.shipped_prefix_tokens,
        "egress_bytes": cluster.egress_bytes,
        "link": link.describe(),
    }}
