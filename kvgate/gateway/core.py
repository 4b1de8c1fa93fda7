"""The core every front door serves from, built once: the fleet, the planner, the account and the feedback.

`build_gateway(settings)` loads the tokenizer (so a bad --tokenizer fails before serving) and builds
the parts a front door needs to route and to learn from answers (state.py's `Gateway`);
`running_fleet(gateway)` runs, for as long as its front door serves, what keeps them current: health
checks, engine stats and context lengths, account expiry and sync, the engines' KV events. The
OpenAI HTTP server (app.py) and the Envoy endpoint picker (ext_proc/) each only translate their
protocol around this core.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import aiohttp
from prometheus_client import CollectorRegistry

from kvgate.config.pd import check_pd_serving
from kvgate.config.settings import InstanceConfig, KVSBackendName, Settings
from kvgate.discovery import start_discovery
from kvgate.gateway.auth_failures import AuthFailureBudget
from kvgate.gateway.background import every
from kvgate.gateway.errors import APIError
from kvgate.gateway.feedback.dispatch import DispatchFeedback
from kvgate.gateway.feedback.hit_accounting import HitAccounting
from kvgate.gateway.feedback.prfaas import PrfaasLink
from kvgate.gateway.feedback.ttft import TTFTFeedback
from kvgate.gateway.fleet.account_sync import AccountSync
from kvgate.gateway.fleet.changes import GatewayFleet
from kvgate.gateway.fleet.engine_context import EngineContextProbe
from kvgate.gateway.fleet.engine_stats import EngineStatsPoller
from kvgate.gateway.fleet.health import HealthChecker
from kvgate.gateway.fleet.inflight import InflightTracker
from kvgate.gateway.fleet.outliers import OutlierDetector
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.planning.prompt_limit import PromptLimit
from kvgate.gateway.planning.prompt_window import PromptWindow
from kvgate.gateway.planning.routing import RoutePlan, RoutePlanner
from kvgate.gateway.planning.tokenizer import TokenizerService, load_tokenizer
from kvgate.gateway.protocol import ParsedRequest
from kvgate.gateway.state import Gateway
from kvgate.gateway.tracing import start_tracing
from kvgate.kvs_client import EmbeddedKVSIndex, ResilientKVSClient, make_kvs_client
from kvgate.kvs_client.events import events_enabled
from kvgate.kvs_client.events.index import EventsIndex
from kvgate.kvs_client.events.subscriber import EventsSubscriber
from kvgate.kvs_client.events.view import EventsView
from kvgate.metrics.computed import COPY_INTERVAL_S, ComputedGauges
from kvgate.metrics.definitions import (
    KVEventsLookupMetrics,
    account_sync_metrics,
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
    from kvgate.gateway.tracing.spans import RequestTrace
    from kvgate.gateway.worker_share import WorkerShare

# How often stale dispatch entries are dropped from the account (its staleness is seconds).
EXPIRY_INTERVAL_S = 1.0

# A periodic job of a front door or of the fleet: (interval in seconds, the job, its name in logs).
Job = tuple[float, Callable[[], Awaitable[None]], str]


def build_gateway(
    settings: Settings,
    *,
    kvs_index: EmbeddedKVSIndex | None = None,
    tokenizer: Any = None,
    shared: WorkerShare | None = None,
) -> Gateway:
    """The core. `kvs_index` replaces the configured KV store by an in-process index; `tokenizer`
    (a loaded Hugging Face tokenizer) saves loading one per gateway in tests and demos; `shared`
    makes it one worker of several (registry and account rows in shared memory)."""
    check_pd_serving(settings.instances, settings.pd_protocol)
    prometheus = CollectorRegistry()
    metrics = gateway_metrics(prometheus)
    scheduler = Scheduler(settings, settings.instances)
    account = LoadAccount(settings.request_local_account_staleness_s, shared.rows if shared is not None else None)
    tokenizer_service = TokenizerService(
        tokenizer if tokenizer is not None else load_tokenizer(settings.tokenizer, settings.chat_template),
        cache_bytes=settings.tokenize_cache_bytes,
    )
    computed = ComputedGauges(into_files=shared is not None)  # workers merge their metrics from files
    computed.bind(metrics.tokenize_cache_bytes, lambda: tokenizer_service.cached_bytes)
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
    tracker = InflightTracker(account, metrics)
    hits = HitAccounting(hit_metrics(prometheus), settings.kvs_chunk_size)
    outliers = OutlierDetector(registry, metrics, settings.outlier_consecutive_failures, settings.outlier_ejection_s)
    feedback = DispatchFeedback(tracker, metrics, outliers, hits,
                                TTFTFeedback(scheduler, ttft_metrics(prometheus), computed))
    gateway = Gateway(settings, prometheus, metrics, registry, scheduler, account, tracker, tokenizer_service, kvs,
                      planner, hits, auth_failures, feedback, decode_ledger, computed=computed, shared=shared,
                      events=events)
    if scheduler.prfaas is not None:
        gateway.prfaas = PrfaasLink(scheduler.prfaas, prfaas_metrics(prometheus), computed)
    gateway.tracing = start_tracing(settings, events is not None)
    for state in registry.states():
        metrics.instance_healthy.labels(state.id).set(1)
    return gateway


def _events_view(
    settings: Settings, shared: WorkerShare | None, prometheus: CollectorRegistry
) -> tuple[EventsView | None, KVEventsLookupMetrics | None]:
    """The events index this gateway reads: the one its supervisor's subscriber writes (workers),
    or its own (a single process, whose lifecycle runs the subscriber)."""
    if not events_enabled(settings):
        return None, None
    if shared is not None:
        if not shared.events_index_path:
            return None, None
        index = EventsIndex.attach(shared.events_index_path)
    else:
        index = EventsIndex.create(settings.kv_events_index_bytes, settings.kv_events_max_instances)
    lookup_metrics = kv_events_lookup_metrics(prometheus)
    return EventsView(index, lookup_metrics), lookup_metrics


async def plan_admitted(gateway: Gateway, parsed: ParsedRequest, trace: RequestTrace | None = None) -> RoutePlan:
    """The plan for a request the rejection filter lets through (APIError 429 with Retry-After when
    it refuses); the planner's own refusals (404, 400, 503) are raised as they are. A traced
    request's spans get the planner's stages and decision."""
    plan = await gateway.planner.plan(parsed)
    if trace is not None:
        trace.planned(plan)
    # The rejection filter; a prefill/decode split passes its decode instance's load here.
    rejection = gateway.scheduler.judge(plan.decision, plan.candidates, plan.decode_load)
    if rejection is not None:
        gateway.metrics.admission_rejections.inc()
        if trace is not None:
            trace.rejected(rejection.code)
        raise APIError(429, rejection.message, code=rejection.code,
                       headers={"Retry-After": str(rejection.retry_after_s)})
    return plan


@contextlib.asynccontextmanager
async def running_fleet(gateway: Gateway, front_door_jobs: Sequence[Job] = ()) -> AsyncIterator[None]:
    """Keep the core current while its front door serves (the front door's own periodic jobs run
    beside); on exit stop every job and close the store, the probes' session and the tokenizer."""
    settings = gateway.settings
    # The periodic probes use one aiohttp session (requests go through the front door's own means).
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

    jobs: list[Job] = [
        (EXPIRY_INTERVAL_S, expire, "account expiry"),
        *([(COPY_INTERVAL_S, gateway.computed.copy_job, "computed gauges")] if gateway.computed.copying else []),
        (settings.health_check_interval_s, context_probe.learn_all, "engine context lengths"),
        *front_door_jobs,
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
    if gateway.shared is None or gateway.shared.leader:  # one follower of the fleet per gateway
        discovery = start_discovery(settings, GatewayFleet(gateway), gateway.prometheus)
        tasks += [discovery] if discovery is not None else []
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
        if gateway.kvs is not None:
            await gateway.kvs.close()
        gateway.tokenizer.close()
        if gateway.tracing is not None:  # last: the front door's requests have ended their spans
            await gateway.tracing.close()


# Young-generation threshold of the gateway process (CPython's default is 700). Answered requests
# leave no reference cycles (checked for whole, streamed, retried and refused ones; only a pydantic
# refusal leaves one), so young collections free next to nothing; but at concurrency 32 the requests
# in flight alone hold ~2,000 tracked objects, and with 700 a young collection ran every few
# requests, walked them all and promoted them: 0.25 ms each, ~6 us per request on average.
GC_YOUNG_THRESHOLD = 10_000


def tune_gc() -> None:
    """For a process that only serves, called once everything is loaded. Freezing takes the ~110,000
    objects of start-up (transformers' modules, the tokenizer and its vocabulary) out of the
    collector's sight: a full collection walked them in 55 ms, a pause every request in flight
    waited through, and takes well under a millisecond without them. The raised young threshold is
    explained at GC_YOUNG_THRESHOLD."""
    gc.collect()
    gc.freeze()
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)
