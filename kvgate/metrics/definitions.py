"""Every Prometheus metric kvgate exports: names, labels and buckets in one place.

Metrics are created on a registry passed in (one per gateway) so tests and several gateways in
one process never collide on the global default registry.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

# Seconds; spans sub-millisecond store lookups up to multi-second long-prompt prefills.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_KEY_COUNT_BUCKETS = (1, 4, 16, 64, 256, 512, 1024, 4096, 16384)
_RATIO_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


@dataclass(frozen=True)
class KVSMetrics:
    query_seconds: Histogram
    query_outcomes: Counter  # outcome: hit | miss | error | skipped_down
    keys_per_query: Histogram
    service_up: Gauge
    oversized_answers: Counter


@dataclass(frozen=True)
class GatewayMetrics:
    requests: Counter  # route, status
    ttft_seconds: Histogram
    e2e_seconds: Histogram
    stage_seconds: Histogram  # stage: tokenize | kvs | schedule
    prefix_hit_ratio: Histogram
    forward_retries: Counter  # instance
    admission_rejections: Counter
    inflight_requests: Gauge  # instance
    inflight_prefill_tokens: Gauge  # instance
    instance_healthy: Gauge  # instance
    outlier_ejections: Counter  # instance
    tokenize_cache_bytes: Gauge
    routing_panic: Gauge  # model
    # --- untrusted input at the edges: clients' headers, engines' answers ---
    auth_failures_throttled: Counter  # scope: api_key | admin
    malformed_requests: Counter  # reason
    engine_values_refused: Counter  # field


# --- TTFT model: prediction error and calibration (scheduler/ttft.py) ---
# Measured minus predicted TTFT, seconds: negative when the model was pessimistic.
_ERROR_BUCKETS = (-10, -5, -2.5, -1, -0.5, -0.25, -0.1, -0.05, -0.01, 0, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


@dataclass(frozen=True)
class TTFTMetrics:
    prediction_error_seconds: Histogram
    calibration_factor: Gauge  # instance, term: compute | transfer
    calibration_observations: Gauge  # instance


def ttft_metrics(registry: CollectorRegistry) -> TTFTMetrics:
    return TTFTMetrics(
        prediction_error_seconds=Histogram(
            "kvgate_ttft_prediction_error_seconds",
            "Measured minus predicted TTFT (first byte minus dispatch) on the instance the request went to.",
            buckets=_ERROR_BUCKETS, registry=registry,
        ),
        calibration_factor=Gauge(
            "kvgate_ttft_calibration_factor",
            "Per-instance factor the TTFT model applies to its profile's compute (queue + prefill) or transfer.",
            # Each worker calibrates on its own requests: the one whose factor moved last is shown.
            ["instance", "term"], registry=registry, multiprocess_mode="livemostrecent",
        ),
        calibration_observations=Gauge(
            "kvgate_ttft_calibration_observations", "Measured TTFTs the instance's calibration has used.",
            ["instance"], registry=registry, multiprocess_mode="livesum",
        ),
    )


def kvs_metrics(registry: CollectorRegistry) -> KVSMetrics:
    return KVSMetrics(
        query_seconds=Histogram(
            "kvgate_kvs_query_seconds",
            "Time spent asking the KV store which endpoints hold a request's blocks (retries included).",
            ["backend"],
            buckets=_LATENCY_BUCKETS,
            registry=registry,
        ),
        query_outcomes=Counter(
            "kvgate_kvs_queries",
            "KV store lookups by outcome: hit (some block found), miss, error, skipped_down.",
            ["backend", "outcome"],
            registry=registry,
        ),
        keys_per_query=Histogram(
            "kvgate_kvs_keys_per_query",
            "Number of block keys asked in one lookup.",
            ["backend"],
            buckets=_KEY_COUNT_BUCKETS,
            registry=registry,
        ),
        service_up=Gauge(
            "kvgate_kvs_service_up",
            "1 while the metadata service is considered up, 0 while it is marked down.",
            ["backend"],
            registry=registry,
        ),
        oversized_answers=Counter(
            "kvgate_kvs_oversized_answers",
            "KV store answers longer than --kvs-max-answer-bytes, not parsed (the lookup failed).",
            ["backend"],
            registry=registry,
        ),
    )


def gateway_metrics(registry: CollectorRegistry) -> GatewayMetrics:
    return GatewayMetrics(
        requests=Counter(
            "kvgate_requests",
            "Requests answered, by route and HTTP status; 499 = the client hung up, stream_error = a "
            "stream the engine broke after its first byte (sent as 200, ended with an error event).",
            ["route", "status"],
            registry=registry,
        ),
        ttft_seconds=Histogram(
            "kvgate_ttft_seconds", "Time from request arrival to the first byte relayed to the client.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        ),
        e2e_seconds=Histogram(
            "kvgate_e2e_seconds", "Time from request arrival to the end of the response.",
            buckets=_LATENCY_BUCKETS, registry=registry,
        ),
        stage_seconds=Histogram(
            "kvgate_stage_seconds", "Time spent in each routing stage.", ["stage"],
            buckets=_LATENCY_BUCKETS, registry=registry,
        ),
        prefix_hit_ratio=Histogram(
            "kvgate_prefix_hit_ratio", "Prefix hit tokens / prompt tokens on the selected instance.",
            buckets=_RATIO_BUCKETS, registry=registry,
        ),
        forward_retries=Counter(
            "kvgate_forward_retries", "Requests retried on another instance, by the instance that failed.",
            ["instance"], registry=registry,
        ),
        admission_rejections=Counter(
            "kvgate_admission_rejections", "Requests refused with 429 because they are predicted to miss the TTFT or TBT SLO.",
            registry=registry,
        ),
        inflight_requests=Gauge(
            "kvgate_inflight_requests", "Requests dispatched to an instance and not yet finished.", ["instance"],
            registry=registry,
        ),
        inflight_prefill_tokens=Gauge(
            "kvgate_inflight_prefill_tokens", "Uncomputed prompt tokens dispatched to an instance awaiting first token.",
            ["instance"], registry=registry,
        ),
        instance_healthy=Gauge(
            "kvgate_instance_healthy", "1 while the instance passes health checks, 0 while ejected.", ["instance"],
            registry=registry,
        ),
        outlier_ejections=Counter(
            "kvgate_outlier_ejections",
            "Instances ejected after --outlier-consecutive-failures failed requests in a row.", ["instance"],
            registry=registry,
        ),
        tokenize_cache_bytes=Gauge(
            "kvgate_tokenize_cache_bytes", "Bytes held by the tokenize cache (bounded by --tokenize-cache-bytes).",
            registry=registry, multiprocess_mode="livesum",  # one cache per worker
        ),
        # Set by the health checks, which run in one worker: "livemax" reports its value once.
        routing_panic=Gauge(
            "kvgate_routing_panic",
            "1 while every instance of a model (in one role) is ejected and requests are routed to them anyway.",
            ["model"], registry=registry, multiprocess_mode="livemax",
        ),
        auth_failures_throttled=Counter(
            "kvgate_auth_failures_throttled",
            "Requests refused with 429 because their client address spent its failed-authentication budget "
            "(--auth-failure-budget), by scope: api_key (/v1/*) or admin.",
            ["scope"], registry=registry,
        ),
        malformed_requests=Counter(
            "kvgate_malformed_requests",
            "Requests the HTTP parser refused before any route saw them (bad header bytes, a header over "
            "the size limit, too many headers), by reason.",
            ["reason"], registry=registry,
        ),
        engine_values_refused=Counter(
            "kvgate_engine_values_refused",
            "Values from engines refused or clamped as impossible (negative or oversized usage numbers, "
            "scraped gauges that are not finite, malformed kv_transfer_params, SSE events over "
            "--max-sse-event-bytes, streams ended without data: [DONE]), by field.",
            ["field"], registry=registry,
        ),
    )


# --- scale-out: the account shared between gateway replicas ---


@dataclass(frozen=True)
class AccountSyncMetrics:
    up: Gauge
    replicas: Gauge
    failures: Counter
    rejected: Counter  # reason: too_large | wrong_type | not_json | bad_schema | out_of_range | too_many_peers


def account_sync_metrics(registry: CollectorRegistry) -> AccountSyncMetrics:
    # With several workers only the leader syncs: "livemax" reports its value, not one per process.
    return AccountSyncMetrics(
        up=Gauge("kvgate_account_sync_up",
                 "1 while the account sync store answers, 0 while this replica counts only its own dispatches.",
                 registry=registry, multiprocess_mode="livemax"),
        replicas=Gauge("kvgate_account_sync_replicas", "Other gateway replicas whose rows were folded in last.",
                       registry=registry, multiprocess_mode="livemax"),
        failures=Counter("kvgate_account_sync_failures", "Account sync rounds that failed (store down or slow).",
                         registry=registry),
        rejected=Counter("kvgate_account_sync_rejected",
                         "Other replicas' published values dropped (malformed, too large, beyond the peer limit), by reason.", ["reason"],
                         registry=registry),
    )


# --- client API keys (gateway/http/auth.py) ---
@dataclass(frozen=True)
class ClientKeyMetrics:
    requests: Counter  # key (the key's name, never the key), outcome: accepted | rate_limited | inflight_limited
    unauthorized: Counter


def client_key_metrics(registry: CollectorRegistry) -> ClientKeyMetrics:
    return ClientKeyMetrics(
        requests=Counter(
            "kvgate_api_key_requests",
            "Requests to /v1/* by API key name and outcome: accepted, rate_limited, inflight_limited.",
            ["key", "outcome"], registry=registry,
        ),
        unauthorized=Counter(
            "kvgate_api_key_unauthorized", "Requests to /v1/* refused with 401 (no key or an unknown key).",
            registry=registry,
        ),
    )


# --- closed-loop hit accounting: predicted vs engine-reported cached tokens (gateway/feedback/hit_accounting.py) ---


@dataclass(frozen=True)
class HitMetrics:
    predicted_tokens: Counter  # instance
    reported_tokens: Counter  # instance
    disagreement_tokens: Counter  # instance
    comparisons: Counter  # instance, outcome: agree | engine_higher | gateway_higher | unreported


def hit_metrics(registry: CollectorRegistry) -> HitMetrics:
    return HitMetrics(
        predicted_tokens=Counter(
            "kvgate_predicted_cached_tokens",
            "Prompt tokens the store or the KV events held on the instance when the gateway routed to it (its predicted "
            "prefix hit), over answers whose engine reported cached tokens.",
            ["instance"], registry=registry,
        ),
        reported_tokens=Counter(
            "kvgate_reported_cached_tokens",
            "Prompt tokens the engine reported cached (usage.prompt_tokens_details.cached_tokens).",
            ["instance"], registry=registry,
        ),
        disagreement_tokens=Counter(
            "kvgate_cached_tokens_disagreement",
            "Sum over answers of |reported - predicted| cached prompt tokens.",
            ["instance"], registry=registry,
        ),
        comparisons=Counter(
            "kvgate_hit_comparisons",
            "Answers compared with their predicted prefix hit, by outcome: agree (within one chunk), "
            "engine_higher, gateway_higher, unreported (no cached_tokens in the usage).",
            ["instance", "outcome"], registry=registry,
        ),
    )


# --- Prefill-as-a-Service: the cluster rule's state (scheduler/prfaas.py, gateway/feedback/prfaas.py) ---


@dataclass(frozen=True)
class PrfaasMetrics:
    egress_gbps: Gauge
    link_utilisation: Gauge
    threshold_tokens: Gauge
    offload_fraction: Gauge
    decisions: Counter  # cluster
    egress_bytes: Counter


def prfaas_metrics(registry: CollectorRegistry) -> PrfaasMetrics:
    return PrfaasMetrics(
        egress_gbps=Gauge(
            "kvgate_prfaas_egress_gbps",
            "Estimated KV egress on the PrfaaS -> local link over --prfaas-link-window-s, Gbit/s.",
            registry=registry, multiprocess_mode="livesum",  # each worker counts its own requests' bytes
        ),
        link_utilisation=Gauge(
            "kvgate_prfaas_link_utilisation", "The egress estimate over --prfaas-egress-gbps.", registry=registry,
            multiprocess_mode="livesum",
        ),
        threshold_tokens=Gauge(
            "kvgate_prfaas_threshold_tokens",
            "Offload threshold in force (incremental prompt tokens), as adapted within its bounds.",
            registry=registry, multiprocess_mode="livemostrecent",
        ),
        offload_fraction=Gauge(
            "kvgate_prfaas_offload_fraction",
            "Share of the disaggregated requests within the link window prefilled in the PrfaaS cluster.",
            registry=registry, multiprocess_mode="livemostrecent",
        ),
        decisions=Counter(
            "kvgate_prfaas_decisions", "Disaggregated requests by the cluster that prefilled them.", ["cluster"],
            registry=registry,
        ),
        egress_bytes=Counter(
            "kvgate_prfaas_egress_bytes", "KV bytes the gateway caused to cross the PrfaaS -> local link.",
            registry=registry,
        ),
    )


# --- tokenizing only what routing needs (gateway/planning/prompt_window.py, --tokenize-tail estimate) ---


@dataclass(frozen=True)
class TokenizeTailMetrics:
    estimated_prompts: Counter
    extensions: Counter
    background: Counter  # outcome: completed | failed | dropped


def tokenize_tail_metrics(registry: CollectorRegistry) -> TokenizeTailMetrics:
    return TokenizeTailMetrics(
        estimated_prompts=Counter(
            "kvgate_tokenize_estimated_prompts",
            "Text prompts routed on exact leading ids and an estimated length (the rest tokenized later).",
            registry=registry,
        ),
        extensions=Counter(
            "kvgate_tokenize_extensions",
            "Times a prompt's tokenized window grew because the KV store held its last looked-up block.",
            registry=registry,
        ),
        background=Counter(
            "kvgate_tokenize_background",
            "Prompt tails handed to the background tokenizer, by outcome (dropped: too many pending).",
            ["outcome"], registry=registry,
        ),
    )


# --- engines' KV events (kvs_client/events/, docs/KV_EVENTS.md) ---
# Seconds between an engine publishing a batch and the index applying it (clocks must agree).
_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


@dataclass(frozen=True)
class KVEventsMetrics:
    """Written by the one subscriber of a gateway (a process of its own under --workers N: gauges
    sum over live processes, which is that one)."""

    received: Counter  # instance: messages (batches) read from its socket, replayed ones included
    applied: Counter  # instance: events applied to the index
    dropped: Counter  # instance, reason
    gaps: Counter  # instance
    replays: Counter  # instance, outcome: repaired | incomplete | failed
    resets: Counter  # instance, reason: restart | cleared | gap | malformed | stopped
    orphans: Counter  # instance: blocks stored whose parent the index did not hold
    blocks: Gauge  # instance, medium
    lag_seconds: Histogram
    silent_instances: Gauge
    subscriptions: Gauge
    index_rows: Gauge  # state: used | capacity


def kv_events_metrics(registry: CollectorRegistry) -> KVEventsMetrics:
    def gauge(name: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name, doc, list(labels), registry=registry, multiprocess_mode="livesum")

    return KVEventsMetrics(
        received=Counter("kvgate_kv_events_received", "KV event batches received from an instance's engine.",
                         ["instance"], registry=registry),
        applied=Counter("kvgate_kv_events_applied", "KV events applied to the events index.", ["instance"],
                        registry=registry),
        dropped=Counter(
            "kvgate_kv_events_dropped",
            "KV event batches or events not applied, by reason (not_msgpack, bad_batch, bad_event, bad_hash, "
            "bad_frames, block_size, index_full, duplicate, ignored).",
            ["instance", "reason"], registry=registry,
        ),
        gaps=Counter("kvgate_kv_events_gaps", "Sequence gaps seen in an instance's events.", ["instance"],
                     registry=registry),
        replays=Counter("kvgate_kv_events_replays",
                        "Replays asked of an engine, by outcome (repaired, incomplete, failed).",
                        ["instance", "outcome"], registry=registry),
        resets=Counter("kvgate_kv_events_resets",
                       "Times the index dropped an instance's blocks, by reason (restart, cleared, gap, malformed, "
                       "stopped).", ["instance", "reason"], registry=registry),
        orphans=Counter("kvgate_kv_events_orphan_blocks",
                        "Stored blocks whose parent block the index did not hold (indexed anyway).",
                        ["instance"], registry=registry),
        blocks=gauge("kvgate_kv_events_blocks", "Blocks the events index holds for an instance, by medium.",
                     ("instance", "medium")),
        lag_seconds=Histogram("kvgate_kv_events_lag_seconds",
                              "Time from an engine publishing a batch to the index applying it.",
                              buckets=_LAG_BUCKETS, registry=registry),
        silent_instances=gauge("kvgate_kv_events_silent_instances",
                               "Instances with an events endpoint that have sent nothing since kvgate connected: "
                               "their cache is unknown."),
        subscriptions=gauge("kvgate_kv_events_subscriptions",
                            "Event sockets this gateway has open (one per publishing instance, per machine)."),
        index_rows=gauge("kvgate_kv_events_index_rows", "Rows of the events index, used and capacity.",
                         ("state",)),
    )


@dataclass(frozen=True)
class KVEventsLookupMetrics:
    """Written on the request path, by every worker."""

    lookups: Counter  # outcome: hit | miss | busy
    unmatched: Counter  # reason: lora | cache_salt


def kv_events_lookup_metrics(registry: CollectorRegistry) -> KVEventsLookupMetrics:
    return KVEventsLookupMetrics(
        lookups=Counter("kvgate_kv_events_lookups",
                        "Prompts looked up in the events index, by outcome (busy: the index kept changing).",
                        ["outcome"], registry=registry),
        unmatched=Counter("kvgate_kv_events_unmatched_requests",
                          "Requests routed without the events index because the engine hashes them with keys "
                          "kvgate cannot compute with its kvs_hash_algo, by reason (lora, cache_salt).", ["reason"], registry=registry),
    )


# --- fleet discovery: a file or the Kubernetes API adds and removes instances (kvgate/discovery/) ---
@dataclass(frozen=True)
class DiscoveryMetrics:
    events: Counter  # source, event
    changes: Counter  # change: added | removed | replaced
    errors: Counter  # source, reason
    relists: Counter  # reason
    instances: Gauge
    source_up: Gauge  # source


def discovery_metrics(registry: CollectorRegistry) -> DiscoveryMetrics:
    return DiscoveryMetrics(
        events=Counter("kvgate_discovery_events",
                       "Events read from the discovery source (kubernetes: ADDED, MODIFIED, DELETED, BOOKMARK; "
                       "file: reload).", ["source", "event"], registry=registry),
        changes=Counter("kvgate_discovery_changes",
                        "Changes discovery made to the fleet (added, removed, replaced: a changed instance).",
                        ["change"], registry=registry),
        errors=Counter("kvgate_discovery_errors",
                       "Discovery failures, by reason (api, config, file_unreadable, file_invalid, pod_invalid, "
                       "instance_refused, instance_conflict); the last good fleet stays.",
                       ["source", "reason"], registry=registry),
        relists=Counter("kvgate_discovery_relists",
                        "Full pod lists read from the API server, by reason (start, expired: 410 Gone, error: "
                        "after a failure, pool_changed).", ["reason"], registry=registry),
        instances=Gauge("kvgate_discovery_instances", "Instances in the fleet that discovery put there.",
                        registry=registry, multiprocess_mode="livemax"),
        source_up=Gauge("kvgate_discovery_source_up",
                        "1 while the last read of the discovery source succeeded, 0 while it fails.",
                        ["source"], registry=registry, multiprocess_mode="livemax"),
    )
