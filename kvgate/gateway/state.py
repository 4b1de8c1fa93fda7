"""What one running gateway holds; handlers reach it through `request.app[GATEWAY]`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry

from kvgate.config.settings import Settings
from kvgate.gateway.auth_failures import AuthFailureBudget
from kvgate.gateway.feedback.dispatch import DispatchFeedback
from kvgate.gateway.feedback.hit_accounting import HitAccounting
from kvgate.gateway.feedback.prfaas import PrfaasLink
from kvgate.gateway.fleet.inflight import InflightTracker
from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.planning.routing import RoutePlanner
from kvgate.gateway.planning.tokenizer import TokenizerService
from kvgate.kvs_client import ResilientKVSClient
from kvgate.kvs_client.events.view import EventsView
from kvgate.metrics.computed import ComputedGauges
from kvgate.metrics.definitions import GatewayMetrics
from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.decode import DecodeLedger
from kvgate.scheduler.router import Scheduler

if TYPE_CHECKING:
    from kvgate.gateway.tracing.provider import Tracing
    from kvgate.gateway.worker_share import WorkerShare


@dataclass
class Gateway:
    """Everything one running gateway holds, built once by `core.build_gateway` for its front door."""

    settings: Settings
    prometheus: CollectorRegistry
    metrics: GatewayMetrics
    registry: InstanceRegistry
    scheduler: Scheduler
    account: LoadAccount
    tracker: InflightTracker
    tokenizer: TokenizerService
    kvs: ResilientKVSClient | None  # None: no store (--kvs-backend kv_events)
    planner: RoutePlanner
    hits: HitAccounting
    # Failed authentications per client address (API keys and the admin token).
    auth_failures: AuthFailureBudget
    # What answers teach the core (account, TTFT model, hit accounting, outliers), for every front door.
    feedback: DispatchFeedback
    # Predicted decode tokens per decode instance (prefill/decode disaggregation).
    decode_ledger: DecodeLedger = field(default_factory=DecodeLedger)
    # The Prefill-as-a-Service rule's link and gauges (None without --prfaas-cluster).
    prfaas: PrfaasLink | None = None
    started: int = field(default_factory=lambda: int(time.time()))
    # Gauges computed from the state above (a cache's size, calibration factors, the PrfaaS link).
    computed: ComputedGauges = field(default_factory=lambda: ComputedGauges(into_files=False))
    # One worker of several (`kvgate serve --workers N`): the memory it shares with the others.
    shared: WorkerShare | None = None
    # The engines' KV events index (docs/KV_EVENTS.md); None when no instance publishes events.
    events: EventsView | None = None
    # OpenTelemetry tracing (gateway/tracing/); None when off (no --otlp-traces-endpoint).
    tracing: Tracing | None = None


GATEWAY = web.AppKey("gateway", Gateway)
