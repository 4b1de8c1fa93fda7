"""The gateway's aiohttp application: wiring, lifecycle and the OpenAI routes.

`build_app(settings)` loads the tokenizer (so a bad --tokenizer fails before serving) and returns
an application whose parts that need a running loop (the pooled client session, background
health checks, stats scraping and account expiry) start with it and stop with it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvgate.config.api_keys import load_api_keys
from kvgate.config.pd import check_pd_serving
from kvgate.config.settings import DebugRoutes, InstanceConfig, KVSBackendName, Settings
from kvgate.gateway import access_log, admin, debug
from kvgate.gateway.account_sync import AccountSync
from kvgate.gateway.auth import ClientAuth
from kvgate.gateway.auth_failures import AuthFailureBudget
from kvgate.gateway.background import every
from kvgate.gateway.client_timeout import body_timeout_middleware
from kvgate.gateway.drain import DRAIN, ShutdownDrain
from kvgate.gateway.engine_context import EngineContextProbe
from kvgate.gateway.engine_stats import EngineStatsPoller
from kvgate.gateway.errors import APIError, error_middleware
from kvgate.gateway.forwarder import Forwarder
from kvgate.gateway.health import HealthChecker
from kvgate.gateway.hit_accounting import HitAccounting
from kvgate.gateway.inflight import InflightTracker
from kvgate.gateway.observe import REQUEST_ID, observe_middleware
from kvgate.gateway.outliers import OutlierDetector
from kvgate.gateway.prfaas import PrfaasLink
from kvgate.gateway.prompt_limit import PromptLimit
from kvgate.gateway.prompt_window import PromptWindow
from kvgate.gateway.protocol import ParsedRequest, json_response, parse_chat, parse_completion
from kvgate.gateway.registry import InstanceRegistry
from kvgate.gateway.request_notes import MODEL, PLAN
from kvgate.gateway.routing import RoutePlanner
from kvgate.gateway.state import GATEWAY, Gateway
from kvgate.gateway.tokenizer import TokenizerService, load_tokenizer
from kvgate.gateway.ttft_feedback import TTFTFeedback
from kvgate.gateway.upstream import UpstreamPool
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient, make_kvs_client
from kvgate.kvs_client.events import events_enabled
from kvgate.kvs_client.events.index import EventsIndex
from kvgate.kvs_client.events.subscriber import EventsSubscriber
from kvgate.kvs_client.events.view import EventsView
from kvgate.metrics.definitions import (
    GatewayMetrics,
    KVEventsLookupMetrics,
    account_sync_metrics,
    client_key_metrics,
    gateway_metrics,
    hit_metrics,
    kv_events_lookup_metrics,
    kv_events_metrics,
    kvs_metrics,
    prfaas_metrics,
    tokenize_tail_metrics,
    ttft_metrics,
)
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.decode import DecodeLedger
from kvgate.scheduler.router import Scheduler

if TYPE_CHECKING:
    from kvgate.workers.worker import WorkerShare

# How often stale dispatch entries are dropped from the account (its staleness is seconds) and
# idle upstream connections past their keep-alive are closed.
_EXPIRY_INTERVAL_S = 1.0




def build_app(
    settings: Settings,
    *,
    kvs_index: EmbeddedKVSIndex | None = None,
    tokenizer: Any = None,
    shared: WorkerShare | None = None,
) -> web.Application:
    """The gateway application. `kvs_index` replaces the configured KV store by an in-process index;
    `tokenizer` (a loaded Hugging Face tokenizer) saves loading one per gateway in tests and demos;
    `shared` makes it one worker of several (registry and account rows in shared memory)."""
    check_pd_serving(settings.instances, settings.pd_protocol)
    prometheus = CollectorRegistry()
    metrics = gateway_metrics(prometheus)
    scheduler = Scheduler(settings, settings.instances)
    account = LoadAccount(settings.request_local_account_staleness_s, shared.rows if shared is not None else None)
    tokenizer_service = TokenizerService(
        tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer, settings.chat_template),
        cache_bytes=settings.tokenize_cache_bytes,
    )
    metrics.tokenize_cache_bytes.set_function(lambda: tokenizer_service.cached_bytes)
    prompt_limit = PromptLimit(settings.max_prompt_tokens, tokenizer_service.tokenizer, settings.instances)

    def instances_changed(instances: tuple[InstanceConfig, ...]) -> None:
        scheduler.set_instances(instances)
        prompt_limit.set_instances(instances)

    registry = (
        shared.registry(on_change=instances_changed) if shared is not None
        else InstanceRegistry(settings.instances, on_change=instances_changed)
    )
    store_metrics = kvs_metrics(prometheus)
    kvs: ResilientKVSClient | None = None
    if kvs_index is not None:
        kvs = ResilientKVSClient(kvs_index, settings, store_metrics)
    elif settings.kvs_backend != KVSBackendName.KV_EVENTS:
        kvs = make_kvs_client(settings, metrics=store_metrics)
    events, events_metrics = _events_view(settings, shared, prometheus)
    decode_ledger = DecodeLedger()
    window = PromptWindow.from_settings(settings, tokenize_tail_metrics(prometheus))
    planner = RoutePlanner(scheduler, kvs, tokenizer_service, registry, account, metrics, prompt_limit, window,
                           decode_ledger=decode_ledger, events=events, events_metrics=events_metrics,
                           max_query_blocks=settings.kvs_max_query_blocks)
    auth_failures = AuthFailureBudget(settings.auth_failure_budget, settings.auth_failure_refill_per_s,
                                      metrics.auth_failures_throttled)
    gateway = Gateway(settings, prometheus, metrics, registry, scheduler, account,
                      InflightTracker(account, metrics), tokenizer_service, kvs, planner,
                      HitAccounting(hit_metrics(prometheus), settings.kvs_chunk_size), auth_failures, decode_ledger,
                      shared=shared, events=events)
    if scheduler.prfaas is not None:
        gateway.prfaas = PrfaasLink(scheduler.prfaas, prfaas_metrics(prometheus))
    for state in registry.states():
        metrics.instance_healthy.labels(state.id).set(1)

    drain = ShutdownDrain()
    app = web.Application(client_max_size=settings.max_body_bytes,
                          middlewares=_middlewares(settings, metrics, prometheus, drain, auth_failures))
    app[GATEWAY] = gateway
    app[DRAIN] = drain
    if settings.access_log:
        access_log.enable(app)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/health", _health)
    app.router.add_get("/livez", _livez)
    if settings.debug_routes is not DebugRoutes.OFF:
        guard = admin.admin_only if settings.debug_routes is DebugRoutes.ADMIN else None
        app.router.add_get("/metrics", guard(_metrics) if guard else _metrics)
        debug.add_routes(app, settings.debug_max_concurrent, guard)
    admin.add_routes(app)
    app.cleanup_ctx.append(_lifecycle)
    if shared is not None:
        app.on_response_prepare.append(shared.tag_response)
    return app


def _events_view(
    settings: Settings, shared: WorkerShare | None, prometheus: CollectorRegistry
) -> tuple[EventsView | None, KVEventsLookupMetrics | None]:
    """The events index this gateway reads: the one its supervisor's subscriber writes (workers),
    or its own (a single process, whose lifecycle runs the subscriber)."""
    if not events_enabled(settings):
        return None, None
    if shared is not None:
        if not shared.spec.events_index_path:
            return None, None
        index = EventsIndex.attach(shared.spec.events_index_path)
    else:
        index = EventsIndex.create(settings.kv_events_index_bytes, settings.kv_events_max_instances)
    lookup_metrics = kv_events_lookup_metrics(prometheus)
    return EventsView(index, lookup_metrics), lookup_metrics


def _middlewares(settings: Settings, metrics: GatewayMetrics, prometheus: CollectorRegistry,
                 drain: ShutdownDrain, auth_failures: AuthFailureBudget) -> list:
    """Outermost first: name and count the request, log it, track it for the drain, turn errors
    into OpenAI JSON, check the client's API key, then make sure the body arrives in time."""
    chain = [observe_middleware(metrics)]
    if settings.access_log:
        chain.append(access_log.access_log_middleware)
    chain += [drain.middleware(), error_middleware]
    if settings.api_keys_file:
        auth = ClientAuth(load_api_keys(settings.api_keys_file), settings, client_key_metrics(prometheus),
                          auth_failures)
        chain.append(auth.middleware())
    chain.append(body_timeout_middleware(settings.client_request_timeout_s))
    return chain


async def _lifecycle(app: web.Application) -> AsyncIterator[None]:
    gateway = app[GATEWAY]
    settings = gateway.settings
    # Requests go through the lean upstream pool; the periodic probes use one aiohttp session.
    upstream = UpstreamPool(settings.upstream_connect_timeout_s, settings.upstream_read_timeout_s)
    outliers = OutlierDetector(gateway.registry, gateway.metrics, settings.outlier_consecutive_failures,
                               settings.outlier_ejection_s)
    gateway.registry.on_eject = lambda state: upstream.abort_waiting(state.config.url, f"{state.id} was ejected")
    gateway.forwarder = Forwarder(upstream, settings, gateway.registry, gateway.tracker, gateway.metrics,
                                  outliers, gateway.hits,
                                  ttft_feedback=TTFTFeedback(gateway.scheduler, ttft_metrics(gateway.prometheus)),
                                  decode_ledger=gateway.decode_ledger, prfaas=gateway.prfaas)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))
    checker = HealthChecker(gateway.registry, session, gateway.metrics, settings.health_check_failures_to_eject,
                            timeout_s=min(settings.health_check_interval_s, settings.upstream_connect_timeout_s))
    context_probe = EngineContextProbe(gateway.registry, session, gateway.planner.prompt_limit,
                                       timeout_s=settings.upstream_connect_timeout_s)
    poller = EngineStatsPoller(gateway.registry, session, gateway.account,
                               timeout_s=min(settings.stats_poll_interval_s, settings.upstream_connect_timeout_s),
                               refused=gateway.metrics.engine_values_refused)

    async def expire() -> None:
        gateway.tracker.expire()
        upstream.close_idle()

    jobs: list[tuple[float, Callable[[], Awaitable[None]], str]] = [
        (_EXPIRY_INTERVAL_S, expire, "account expiry and idle connections"),
        (settings.health_check_interval_s, context_probe.learn_all, "engine context lengths"),
    ]
    sync: AccountSync | None = None
    # Probing engines and syncing replicas is done once per gateway: by its leader worker.
    if gateway.shared is None or gateway.shared.leader:
        jobs.append((settings.health_check_interval_s, checker.check_all, "health checks"))
        jobs.append((settings.stats_poll_interval_s, poller.poll_all, "engine stats"))
        if settings.account_sync:
            sync = AccountSync(settings.account_sync, gateway.account.rows,  # type: ignore[arg-type]
                               account_sync_metrics(gateway.prometheus), settings.account_sync_interval_s,
                               settings.account_sync_ttl_s, max_peers=settings.account_sync_max_peers,
                               max_row_bytes=settings.account_sync_max_row_bytes)
            jobs.append((settings.account_sync_interval_s, sync.sync_once, "account sync"))
    tasks = [asyncio.create_task(every(interval, job, name), name=name) for interval, job, name in jobs]
    if gateway.events is not None and gateway.shared is None:  # workers share their supervisor's subscriber
        registry = gateway.registry
        subscriber = EventsSubscriber(
            gateway.events.index, settings, kv_events_metrics(gateway.prometheus),
            lambda: [(state.config, state.healthy and not state.draining) for state in registry.states()])
        tasks.append(asyncio.create_task(subscriber.run(), name="kv events"))
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await session.close()
        if sync is not None:
            await sync.close()
        upstream.close()
        if gateway.kvs is not None:
            await gateway.kvs.close()
        gateway.tokenizer.close()


async def _completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_completion)


async def _chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, parse_chat)


async def _serve(request: web.Request, parse: Callable[[bytes], ParsedRequest]) -> web.StreamResponse:
    arrived = time.perf_counter()
    gateway = request.app[GATEWAY]
    parsed = parse(await request.read())
    request[MODEL] = parsed.model
    plan = request[PLAN] = await gateway.planner.plan(parsed)
    # The rejection filter; a prefill/decode split passes its decode instance's load here.
    rejection = gateway.scheduler.judge(plan.decision, plan.candidates, plan.decode_load)
    if rejection is not None:
        gateway.metrics.admission_rejections.inc()
        raise APIError(429, rejection.message, code=rejection.code,
                       headers={"Retry-After": str(rejection.retry_after_s)})
    assert gateway.forwarder is not None, "the application has not started"
    return await gateway.forwarder.forward(request, parsed, plan, request[REQUEST_ID], arrived)


async def _models(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    data = [{"id": model, "object": "model", "created": gateway.started, "owned_by": "kvgate"}
            for model in gateway.registry.models()]
    return json_response({"object": "list", "data": data})


async def _health(request: web.Request) -> web.Response:
    """Readiness: 503 while no instance can take a request, so load balancers send traffic
    elsewhere; the body says why. (While draining, the listening socket is already closed.) Instances
    routed to in panic (all of their model ejected, registry.py) count as routable: they are tried."""
    states = request.app[GATEWAY].registry.states()
    routable = sum(1 for s in states if s.routable)
    body = {"status": "ok", "instances": len(states), "routable_instances": routable,
            "panic_instances": sum(1 for s in states if s.panic)}
    if not routable:
        reason = "no instance configured" if not states else "no instance is routable (all ejected or draining)"
        return json_response({**body, "status": "unavailable", "reason": reason}, status=503)
    return json_response(body)


async def _livez(request: web.Request) -> web.Response:
    """Liveness: 200 while the process serves HTTP, whatever the instances' state."""
    return json_response({"status": "alive"})


async def _metrics(request: web.Request) -> web.Response:
    gateway = request.app[GATEWAY]
    if gateway.shared is not None:
        from kvgate.workers.whole_metrics import whole_gateway_metrics

        body = whole_gateway_metrics(gateway.shared, gateway.registry)
    else:
        body = generate_latest(gateway.prometheus)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

