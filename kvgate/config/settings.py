"""The one typed settings model for kvgate.

Every flag is a field here. Flag names are the field names with dashes (`kvs_backend` ->
`--kvs-backend`), YAML keys are the field names, environment variables are `KVGATE_` + the
upper-cased field name. Llumnix's names and defaults are kept where a Llumnix flag exists
(REFERENCE.md section 4) so operators can move configurations across.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kvgate.config import instance_rules
from kvgate.config.api_keys import load_api_keys
from kvgate.config.key_formats import check_key_format
from kvgate.config.pd import check_pd_fleet


class KVSBackendName(StrEnum):
    MOONCAKE = "mooncake"
    REDIS = "redis"
    EMBEDDED = "embedded"
    CONDUCTOR = "conductor"  # Mooncake's Conductor KV indexer (POST /query by token ids)
    KV_EVENTS = "kv_events"  # no store: the engines' KV events alone (docs/KV_EVENTS.md)


class HashAlgo(StrEnum):
    SHA256_CBOR = "sha256_cbor"
    SHA256_HEX = "sha256_hex"
    XXHASH = "xxhash"


class KVEventsFormat(StrEnum):
    """Wire formats of engines' KV events (one decoder each, kvgate/kvs_client/events/)."""

    VLLM = "vllm"


class PDProtocol(StrEnum):
    SGLANG = "sglang"
    VLLM = "vllm"


class DebugRoutes(StrEnum):
    PUBLIC = "public"
    ADMIN = "admin"  # behind the admin token
    OFF = "off"


class TokenizeTail(StrEnum):
    """How much of a text prompt is tokenized before routing (docs/OPERATIONS.md)."""

    EXACT = "exact"  # all of it
    ESTIMATE = "estimate"  # up to the first block no instance holds; the rest's length estimated


class InstanceRole(StrEnum):
    NEUTRAL = "neutral"
    PREFILL = "prefill"
    DECODE = "decode"


class DiscoveryName(StrEnum):
    """Where the fleet comes from (docs/DISCOVERY.md)."""

    STATIC = "static"  # the `instances` list alone
    FILE = "file"  # an instance list file, re-read when it changes
    KUBERNETES = "kubernetes"  # the ready pods of a label selector or an InferencePool


class PrfaasBandwidthMode(StrEnum):
    """How a request's cached prefixes in the two clusters are weighed (Prefill-as-a-Service)."""

    AUTO = "auto"  # abundant while the link is below --prfaas-abundant-below-utilisation, else scarce
    SCARCE = "scarce"  # each cluster's cached prefix judged on its own; nothing shipped but the KV
    ABUNDANT = "abundant"  # the longer cached prefix wherever it lies, shipped across when needed


# The default --dispatch-metric-order. Policy and metric names are checked against the scheduler's
# registry (kvgate/scheduler/registry.py), the one place they are listed.
DEFAULT_METRIC_ORDER = (
    "all_prefills_tokens_num",
    "num_waiting_requests",
    "num_requests",
    "kv_cache_usage_ratio",
)


class OTLPProtocol(StrEnum):
    """OTLP transports, named as OTEL_EXPORTER_OTLP_TRACES_PROTOCOL names them."""

    HTTP_PROTOBUF = "http/protobuf"
    GRPC = "grpc"


class EarlyRejection(StrEnum):
    NONE = "none"
    EARLY = "early"
    PREDICTIVE = "predictive"


# The cluster an instance belongs to unless its config names another.
LOCAL_CLUSTER = "local"


class InstanceConfig(BaseModel):
    """One engine instance behind the gateway."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str
    url: str
    model: Annotated[str, Field(min_length=1)]
    role: InstanceRole = InstanceRole.NEUTRAL
    # IPs or IP:port that hold this instance's KV cache in the store (Mooncake transport endpoints).
    kvs_endpoints: tuple[str, ...] = ()
    # The engine's context length (vLLM --max-model-len); bounds the prompts the gateway accepts.
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    # --- prefill/decode disaggregation: a prefill instance's KV hand-off endpoint (docs/PD.md) ---
    # SGLang: its --disaggregation-bootstrap-port (None: SGLang's default 8998). vLLM: set only for the
    # Mooncake connector, whose bootstrap server kvgate names to the decode instance.
    bootstrap_port: Annotated[int | None, Field(ge=1, le=65535)] = None
    bootstrap_host: str = Field("", description="Host of the bootstrap server; empty: the URL's host.")
    # Which cluster the instance lives in; the one named by --prfaas-cluster is the prefill service.
    cluster: Annotated[str, Field(min_length=1)] = LOCAL_CLUSTER
    # --- the engine's KV events (docs/KV_EVENTS.md): kvgate connects a SUB socket here ---
    kv_events_endpoint: str = Field("", description="The engine's KV events PUB socket, tcp://HOST:PORT; empty: none.")
    kv_events_replay_endpoint: str = Field("", description="The engine's replay ROUTER socket, tcp://HOST:PORT.")
    # LoRA adapters the engine serves, name -> the path it loaded it from (vLLM --lora-modules
    # NAME=PATH; its /v1/models lists it as "root"). A request naming NAME as its model goes to such
    # an instance, and its block keys mix in the adapter as the engine's do (docs/ENGINES.md).
    lora_adapters: dict[str, str] = Field(default_factory=dict)

    @field_validator("lora_adapters")
    @classmethod
    def _adapters(cls, value: dict[str, str]) -> dict[str, str]:
        for name, path in value.items():
            if not name or not path:
                raise ValueError("each LoRA adapter needs a name and the path the engine loaded it from")
        return value

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.lora_adapters

    def __hash__(self) -> int:  # frozen, with a dict field: hash what identifies the instance
        return hash((self.id, self.url, self.model))

    @field_validator("kv_events_endpoint", "kv_events_replay_endpoint")
    @classmethod
    def _zmq_address(cls, value: str) -> str:
        if value and not (value.startswith(("tcp://", "ipc://")) and "*" not in value):
            raise ValueError("expected tcp://HOST:PORT (or ipc://PATH) that kvgate connects to; "
                             "the engine binds tcp://*:PORT")
        return value

    @field_validator("id")
    @classmethod
    def _valid_id(cls, value: str) -> str:
        return instance_rules.check_instance_id(value)

    @field_validator("url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        return instance_rules.check_instance_url(value)


class Settings(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # --- scheduling (Llumnix names) ---
    enable_cache_aware_scheduling: bool = Field(
        False, description="Llumnix switch: turns the least_load policy into cache_aware."
    )
    cache_aware_scheduling_min_tokens: int = Field(
        1024, ge=0, description="Prompts shorter than this are routed on load alone."
    )
    cache_aware_queued_tokens_weight: float = Field(
        0.5,
        ge=0,
        description="Weight of an instance's queued prefill tokens against this request's missed "
        "tokens in cache_aware (Llumnix: 1). 0.5 won on hit ratio and P90/P99 TTFT at every load "
        "and cache size simulated on the Mooncake conversation trace (docs/BENCHMARKS.md).",
    )
    dispatch_policy: str = Field(
        "least_load", description="round_robin | least_load | prefix | cache_aware | conductor"
    )
    dispatch_metric_order: tuple[str, ...] = Field(
        DEFAULT_METRIC_ORDER, description="Load metrics compared in order; the first strict difference decides."
    )
    dispatch_top_k: int = Field(1, ge=1, description="Choose at random among the best k instances.")
    request_local_account_staleness_s: float = Field(
        600.0,
        gt=0,
        description="Leak net: a dispatched request with no news for this long leaves the account. "
        "The forwarder releases every entry itself, so this matches the upstream read timeout "
        "rather than Llumnix's 10 s, which undercounts queued prefill exactly when queues are long.",
    )
    hash_seed: str = Field("0", description="Hash seed string (env GO_HASH_SEED, as vLLM's PYTHONHASHSEED).")

    # --- KV store (Llumnix names) ---
    kvs_backend: KVSBackendName = KVSBackendName.MOONCAKE
    kvs_hash_algo: HashAlgo = HashAlgo.SHA256_CBOR
    kvs_chunk_size: int = Field(256, ge=1)
    kvs_enable_save_unfull_chunk: bool = False
    kvs_key_format: str = Field(
        "llumnix",
        description="Key preset (llumnix, sglang_mha, sglang_mla, vllm_mooncake, iris) or a template with {hash}.",
    )
    kvs_model_name: str = Field("", description="Model name used by key formats that embed it.")
    kvs_retry_times: int = Field(5, ge=0)
    kvs_retry_interval_ms: float = Field(100, ge=0)
    kvs_metadata_service_down_duration_s: float = Field(30, ge=0)
    kvs_query_budget_ms: float = Field(
        50, gt=0, description="Total time one request may spend asking the store, retries included."
    )
    kvs_iris_meta_prefix: str = "iris."
    kvs_vllm_block_prefix: str = "block.hash.key."
    kvs_metadata_service_http_server_host: str = "127.0.0.1"
    kvs_metadata_service_http_server_port: int = Field(9003, ge=1, le=65535)
    kvs_redis_url: str = "redis://127.0.0.1:6379/0"
    kvs_redis_key_prefix: str = Field("kvgate:kv:", description="Namespace of the Redis block index.")
    kvs_redis_block_ttl_s: float = Field(
        60, gt=0, description="Lifetime of an engine's claim in the Redis index unless the engine refreshes it."
    )
    kvs_batch_query_max_url_bytes: int = Field(
        131072, ge=1024, description="Longer Mooncake batch_query_keys URLs are split into concurrent requests."
    )
    kvs_query_disk_tier: bool = Field(
        False, description="Also report blocks on disk tiers (Mooncake: local SSD, NVMe-oF, shared storage; "
        "Conductor indexer: DISK and unknown media).",
    )

    # --- KV store: Mooncake's Conductor indexer, --kvs-backend conductor (docs/KVS.md) ---
    kvs_conductor_url: str = Field(
        "http://127.0.0.1:13333", description="Base URL of the Conductor indexer's HTTP server (POST /query)."
    )
    kvs_conductor_tenant: str = Field("default", min_length=1, description="tenant_id asked of the indexer.")
    kvs_conductor_model: str = Field(
        "", description="Model name the engines registered with the indexer; empty: the request's model."
    )
    kvs_conductor_lora_name: str = Field("", description="lora_name asked of the indexer; empty: the base model.")
    kvs_conductor_cache_salt: str = Field("", description="cache_salt asked of the indexer; empty: none.")

    # --- engines' KV events: an index of what each engine's cache holds (docs/KV_EVENTS.md) ---
    kv_events_topic: str = Field(
        "", description="Topic subscribed to on every instance's events socket; empty = all (vLLM's: kv-events)."
    )
    kv_events_format: KVEventsFormat = Field(KVEventsFormat.VLLM, description="Wire format of the engines' events.")
    kv_events_max_instances: int = Field(
        64, ge=1, le=4096, description="Instances the events index can track at once (a bit per instance per block)."
    )
    kv_events_index_bytes: int = Field(
        64 * 1024 * 1024, ge=1024 * 1024, description="Shared memory of the events index (its block capacity).",
    )
    kv_events_max_blocks_per_instance: int = Field(
        4_000_000, ge=1, description="Blocks the index holds for one instance; further stores are dropped.",
    )
    kv_events_replay_timeout_s: float = Field(
        2.0, gt=0, description="Longest wait for an engine's replay answer before giving the gap up.",
    )

    # --- gateway ---
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tokenizer: str = Field("", description="Local directory or name of a Hugging Face tokenizer (offline).")
    chat_template: str = Field("", description="Jinja chat template file overriding the tokenizer's.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    forward_retries: int = Field(2, ge=0, description="Retries on the next-best instance before the first byte.")
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    upstream_read_timeout_s: float = Field(
        600.0, gt=0, description="Longest gap between an engine's chunks, and the wait for a whole (non-streamed) answer."
    )
    health_check_interval_s: float = Field(2.0, gt=0)
    health_check_failures_to_eject: int = Field(2, ge=1)
    stats_poll_interval_s: float = Field(1.0, gt=0)
    admin_token: str = Field("", description="Bearer token for /admin routes; empty disables them.")
    epp_http_port: int = Field(
        9090, ge=0, le=65535, description="`kvgate epp` (flag --http-port too): port of its HTTP side (metrics, "
        "health, /debug/schedule, admin) beside the gRPC port --port; 0 picks a free one.",
    )
    forward_token_ids: bool = Field(False, description="Send the prompt to engines as token ids.")

    # --- TTFT model, conductor policy and early rejection (docs/SCHEDULING.md) ---
    # Defaults stand for a Llama-3-8B-shaped model (32 layers, 8 KV heads of 128, bf16) on one
    # 80 GB H100-class GPU with one 200 Gb/s RDMA NIC, PCIe 5.0 x16 and a Gen4 NVMe SSD.
    ttft_prefill_points: tuple[tuple[int, float], ...] = Field(
        ((1024, 0.0316), (4096, 0.1457), (8192, 0.343), (16384, 0.891), (32768, 2.603), (131072, 30.1)),
        description="Prefill curve of one idle instance: (prompt tokens, seconds) points, as "
        "'tokens:seconds,...'. Linear between points, the last slope continues.",
    )
    kv_bytes_per_token: int = Field(131072, ge=1, description="KV cache bytes of one token (all layers).")
    kv_host_bandwidth_gb_s: float = Field(
        50.0, gt=0, description="GB/s loading KV from the instance's own DRAM segment (host link)."
    )
    kv_network_bandwidth_gb_s: float = Field(
        25.0, gt=0, description="GB/s loading KV from another instance's segment (transfer engine)."
    )
    kv_disk_bandwidth_gb_s: float = Field(5.0, gt=0, description="GB/s loading KV from a disk tier.")
    decode_step_s: tuple[float, float, float] = Field(
        (0.006, 6e-5, 4e-8),
        description="Decode step time: base seconds, per running sequence, per context token "
        "('base,per_sequence,per_token').",
    )
    prefill_chunk_tokens: int = Field(
        2048, ge=1, description="Engine step token budget (vLLM --max-num-batched-tokens): a decode step "
        "that shares the batch with a prefill chunk of this size takes that much longer.",
    )
    ttft_calibration: bool = Field(
        True, description="Scale the TTFT terms per instance from measured TTFTs (bounded, outlier-robust)."
    )
    kvcache_balancing_threshold: float = Field(
        1.0, ge=1.0, description="Load a longer prefix from another segment only when it is this many "
        "times the local one (Mooncake Conductor's kvcache_balancing_threshold); the TTFT model's rule.",
    )
    ttft_slo_s: float = Field(0.0, ge=0, description="TTFT SLO for early rejection; 0 = off.")
    tbt_slo_s: float = Field(0.0, ge=0, description="Time-between-tokens SLO for early rejection; 0 = off.")
    early_rejection: EarlyRejection = Field(
        EarlyRejection.NONE,
        description="none | early | predictive: answer 429 when the SLOs would be missed. Setting only "
        "--ttft-slo-s turns on early, as before.",
    )
    prefill_tokens_per_s: float | None = Field(
        None, gt=0, description="Deprecated: a flat prefill rate; use --ttft-prefill-points. When set "
        "alone it becomes a linear prefill curve.",
    )

    # --- scale-out: worker processes and gateway replicas sharing one load account ---
    workers: int = Field(
        0, ge=0, description="Gateway processes sharing the port and one load account; 0 = one per available core."
    )
    workers_max_instances: int = Field(
        2048, ge=1, description="Instances the workers' shared table can hold (admin adds beyond it get 409)."
    )
    account_sync: str = Field(
        "", description="redis://host:port/db: replicas share their dispatch accounts through it; empty = off."
    )
    account_sync_interval_s: float = Field(
        0.1, gt=0, description="How often a replica publishes its rows and folds in the others'."
    )
    account_sync_ttl_s: float = Field(
        1.0, gt=0, description="A replica's published rows vanish this long after its last publication."
    )
    account_sync_max_peers: int = Field(
        256, ge=1, description="Other replicas' rows read per sync round at most; keys beyond it are dropped."
    )
    account_sync_max_row_bytes: int = Field(
        512 * 1024, ge=1024,
        description="A replica's published rows larger than this are dropped unread (only this much is fetched).",
    )

    # --- hardening: memory bounds, hung engines, bounded store answers (docs/OPERATIONS.md) ---
    tokenize_cache_bytes: int = Field(
        128 * 1024 * 1024, ge=0,
        description="Bytes the tokenize cache may hold (token ids and their text); 0 disables it.",
    )
    max_prompt_tokens: int = Field(
        0, ge=0,
        description="Longest prompt accepted, in tokens (400 beyond). 0: the model's context, from the "
        "instances' max_model_len, else the tokenizer's model_max_length.",
    )
    upstream_first_byte_timeout_s: float = Field(
        30.0, gt=0,
        description="Longest wait for a stream's first bytes from an engine; past it the request is retried "
        "on another instance. --upstream-read-timeout-s then bounds each gap between chunks.",
    )
    upstream_whole_answer_timeout_s: float = Field(
        600.0, gt=0,
        description="Longest wait for a non-streamed answer (engines send it whole, once generated); past it "
        "the request is retried on another instance.",
    )
    max_sse_event_bytes: int = Field(
        16 * 1024 * 1024, ge=1024,
        description="Longest SSE event relayed from an engine; a longer one ends that stream with an error event.",
    )
    outlier_consecutive_failures: int = Field(
        5, ge=0, description="Eject an instance after this many failed requests in a row (0: off)."
    )
    outlier_ejection_s: float = Field(
        30.0, gt=0, description="An outlier stays ejected at least this long; then a passing health check readmits it.",
    )
    kvs_max_query_blocks: int = Field(
        1024, ge=1, description="Only a prompt's first N blocks are asked of the KV store."
    )
    kvs_max_answer_bytes: int = Field(
        1024 * 1024, ge=1024, description="A longer KV store answer is not parsed: the lookup fails (no hits)."
    )

    # --- tokenizing only what routing needs (docs/OPERATIONS.md, "The tokenize stage") ---
    tokenize_tail: TokenizeTail = Field(
        TokenizeTail.ESTIMATE,
        description="estimate: tokenize a text prompt up to the first block the KV store does not hold "
        "(plus a window), route on an estimated length and finish the rest in the background; exact: "
        "tokenize every prompt whole before routing.",
    )

    # --- prefill/decode disaggregation (docs/PD.md) ---
    pd_protocol: PDProtocol | None = Field(
        None, description="KV hand-off between prefill and decode instances: sglang | vllm (unset: no PD)."
    )
    pd_skip_prefill_below_tokens: int = Field(
        0, ge=0, description="Send a PD request straight to the decode instance when at most this many "
        "prompt tokens are uncached there (vllm only); 0 disables.",
    )

    # --- front door: clients, access control, shutdown (docs/OPERATIONS.md) ---
    client_request_timeout_s: float = Field(
        30.0, gt=0, description="Drop a request whose headers (counted from the connection going idle) or "
        "whose body (counted from the end of its headers) is not complete after this long; also closes "
        "idle keep-alive connections.",
    )
    shutdown_grace_s: float = Field(
        30.0, ge=0, description="On SIGTERM, time in-flight requests get to finish before the rest are "
        "ended with an error.",
    )
    api_keys_file: str = Field(
        "", description="File of client API keys ('name:key' or a bare key per line, # comments); "
        "when set, /v1/* needs 'Authorization: Bearer <key>'.",
    )
    api_key_rate_limit_rps: float = Field(0.0, ge=0, description="Requests per second per API key; 0 = no limit.")
    api_key_rate_limit_burst: int = Field(
        0, ge=0, description="Requests a key may send at once above its rate (0 = one second's worth).",
    )
    api_key_max_inflight: int = Field(0, ge=0, description="Concurrent requests per API key; 0 = no limit.")
    engine_api_key: str = Field(
        "", description="Bearer token sent to engines. Without it, engines get the client's Authorization "
        "header, except with --api-keys-file, whose keys never leave the gateway.",
    )
    debug_routes: DebugRoutes = Field(
        DebugRoutes.PUBLIC, description="public | admin (behind --admin-token) | off: /debug/schedule and /metrics. "
        "Unset with --api-keys-file: admin (what the keys protect is not left open beside them).",
    )
    debug_max_concurrent: int = Field(
        1, ge=1, description="/debug/schedule plans at most this many prompts at once (429 beyond): each "
        "tokenizes a whole prompt.",
    )
    auth_failure_budget: int = Field(
        20, ge=0, description="Failed authentications (wrong API key or admin token) a client address may make "
        "at once before it gets 429 with Retry-After; 0 = no limit.",
    )
    auth_failure_refill_per_s: float = Field(
        1.0, gt=0, description="Failed authentications per second an address regains of its budget.",
    )
    access_log: bool = Field(False, description="One JSON line per request on stdout (logger kvgate.access).")
    instance_networks: tuple[str, ...] = Field(
        (), description="Comma-separated CIDRs instance URLs must point into (IP hosts only); empty = any.",
    )

    # --- Prefill-as-a-Service: a remote prefill cluster for long prompts (docs/PLANNER.md) ---
    prfaas_cluster: str = Field(
        "", description="Cluster of prefill-only instances long prompts are prefilled in; empty = off."
    )
    prfaas_egress_gbps: float = Field(
        0.0, ge=0, description="Bandwidth of the link from the PrfaaS cluster to the local cluster."
    )
    prfaas_kv_bytes_per_token: float = Field(
        0.0, ge=0, description="KV cache bytes per prompt token (used when --prfaas-kv-size-mib is empty)."
    )
    prfaas_kv_size_mib: dict[int, float] = Field(
        default_factory=dict,
        description="KV cache per request by prompt length, e.g. '1024:190.8,8192:308.9' (MiB; "
        "interpolated; hybrid-attention models carry a fixed state a per-token figure misses).",
    )
    prfaas_threshold_tokens: int = Field(
        8192, ge=0, description="Prompts whose uncached part is longer than this are prefilled remotely."
    )
    prfaas_threshold_min_tokens: int = Field(
        2048, ge=0, description="Lowest threshold adaptation may set when local prefill saturates."
    )
    prfaas_threshold_max_tokens: int = Field(
        131072, ge=0, description="Highest threshold adaptation may set when the link or PrfaaS saturates."
    )
    prfaas_bandwidth_mode: PrfaasBandwidthMode = Field(
        PrfaasBandwidthMode.AUTO, description="auto | scarce | abundant (how cached prefixes are weighed)."
    )
    prfaas_abundant_below_utilisation: float = Field(
        0.5, ge=0, le=1, description="In auto mode the link counts as abundant below this utilisation."
    )
    prfaas_link_saturated_utilisation: float = Field(
        0.9, gt=0, le=1, description="Link utilisation at which the threshold rises (fewer prompts cross)."
    )
    prfaas_queue_saturated_tokens: int = Field(
        65536, ge=1, description="Queued prefill tokens per instance at which a cluster counts as saturated."
    )
    prfaas_link_window_s: float = Field(10.0, gt=0, description="Window of the link utilisation estimate.")
    prfaas_adapt_interval_s: float = Field(
        5.0, gt=0, description="At most one threshold change per interval."
    )
    prfaas_adapt_factor: float = Field(
        1.25, gt=1, description="Each threshold change multiplies or divides by this."
    )

    # --- fleet discovery: instances added and removed as a file or Kubernetes says (docs/DISCOVERY.md) ---
    discovery: DiscoveryName = Field(
        DiscoveryName.STATIC, description="static | file | kubernetes: where instances beyond `instances` come from."
    )
    discovery_file: str = Field("", description="--discovery file: YAML or JSON list of instances, re-read on change.")
    discovery_file_poll_interval_s: float = Field(
        1.0, gt=0, description="How often the discovery file's modification time and inode are checked."
    )
    discovery_namespace: str = Field(
        "", description="Namespace whose pods are watched; empty: the gateway pod's own (else 'default')."
    )
    discovery_label_selector: str = Field("", description="Pods to watch, e.g. 'app=vllm,tier!=canary'.")
    discovery_inference_pool: str = Field(
        "", description="InferencePool (inference.networking.k8s.io/v1) whose selector and target ports name the pods."
    )
    discovery_port: int = Field(
        8000, ge=1, le=65535, description="Engine port on the pods with --discovery-label-selector (annotation "
        "kvgate.io/port overrides it per pod).",
    )
    discovery_model: str = Field("", description="Model of pods without a kvgate.io/model label or annotation.")
    discovery_kubeconfig: str = Field(
        "", description="kubeconfig file; empty: the in-cluster service account, else the default kubeconfig."
    )
    discovery_kube_context: str = Field("", description="kubeconfig context; empty: its current context.")
    discovery_watch_timeout_s: int = Field(
        60, ge=1, description="Each pod watch ends after this long; the InferencePool is re-read before the next.",
    )
    discovery_backoff_max_s: float = Field(
        30.0, gt=0, description="Longest wait between retries while the Kubernetes API server fails.",
    )

    # --- tracing: OpenTelemetry spans of each request, exported over OTLP (docs/OPERATIONS.md, "Tracing") ---
    otlp_traces_endpoint: str = Field(
        "", description="OTLP traces endpoint: http/protobuf a full URL (http://collector:4318/v1/traces), grpc "
        "host:port or a URL (http:// = no TLS); empty: tracing off. Needs pip install 'kvgate[tracing]'.",
    )
    otlp_traces_protocol: OTLPProtocol = Field(
        OTLPProtocol.HTTP_PROTOBUF, description="http/protobuf | grpc (also read from the environment as "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL, then OTEL_EXPORTER_OTLP_PROTOCOL, below KVGATE_*).",
    )
    otlp_traces_sample_ratio: float = Field(
        1.0, ge=0, le=1, description="Share of new traces recorded; a request carrying a traceparent follows "
        "its sampled flag.",
    )
    otlp_service_name: str = Field(
        "kvgate", min_length=1, description="service.name of kvgate's spans (also read from OTEL_SERVICE_NAME)."
    )

    instances: tuple[InstanceConfig, ...] = ()

    @field_validator("prfaas_kv_size_mib", mode="before")
    @classmethod
    def _parse_kv_table(cls, value):
        # From a flag or the environment the table comes as "1024:190.8,8192:308.9".
        if isinstance(value, str):
            pairs = [part.split(":", 1) for part in value.split(",") if part.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError("expected LENGTH:MIB pairs separated by commas, e.g. 1024:190.8,8192:308.9")
            value = {key.strip(): mib.strip() for key, mib in pairs}
        return value

    @model_validator(mode="after")
    def _prfaas_consistent(self) -> Settings:
        if not self.prfaas_cluster:
            return self
        if self.prfaas_cluster == LOCAL_CLUSTER:
            raise ValueError(f"prfaas_cluster cannot be {LOCAL_CLUSTER!r}, every instance's default cluster")
        if self.prfaas_egress_gbps <= 0:
            raise ValueError("prfaas_egress_gbps must be > 0 when prfaas_cluster is set")
        if not self.prfaas_kv_size_mib and self.prfaas_kv_bytes_per_token <= 0:
            raise ValueError("prfaas_cluster needs prfaas_kv_size_mib or prfaas_kv_bytes_per_token")
        if self.prfaas_kv_size_mib and (
            len(self.prfaas_kv_size_mib) < 2
            or min(self.prfaas_kv_size_mib) < 1
            or min(self.prfaas_kv_size_mib.values()) < 0
        ):
            raise ValueError("prfaas_kv_size_mib needs two lengths or more, lengths >= 1, sizes >= 0")
        # The PrfaaS cluster only prefills: its KV goes to a local decode instance (docs/PRFAAS.md).
        misplaced = [i.id for i in self.instances if i.cluster == self.prfaas_cluster and i.role != "prefill"]
        if misplaced:
            raise ValueError(f"instances {misplaced} are in the PrfaaS cluster {self.prfaas_cluster!r} "
                             "but their role is not prefill")
        if (
            not self.prfaas_threshold_min_tokens
            <= self.prfaas_threshold_tokens
            <= self.prfaas_threshold_max_tokens
        ):
            raise ValueError(
                "prfaas thresholds must satisfy min <= threshold <= max "
                f"({self.prfaas_threshold_min_tokens} <= {self.prfaas_threshold_tokens} "
                f"<= {self.prfaas_threshold_max_tokens})"
            )
        return self

    @field_validator("dispatch_metric_order", "instance_networks", mode="before")
    @classmethod
    def _split_comma_list(cls, value):
        # From a flag or the environment a list comes as "a,b,c"; empty parts are dropped.
        if isinstance(value, str):
            value = [part.strip() for part in value.split(",") if part.strip()]
        return value

    @field_validator("dispatch_metric_order")
    @classmethod
    def _some_metric(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("needs at least one metric")
        return value

    @field_validator("ttft_prefill_points", mode="before")
    @classmethod
    def _split_points(cls, value):
        if isinstance(value, str):
            pairs = [part.split(":") for part in value.split(",") if part.strip()]
            if any(len(pair) != 2 for pair in pairs):
                raise ValueError("expected 'tokens:seconds,tokens:seconds,...'")
            value = [(pair[0].strip(), pair[1].strip()) for pair in pairs]
        return value

    @field_validator("ttft_prefill_points")
    @classmethod
    def _increasing_points(cls, value: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
        tokens = [n for n, _ in value]
        if not value or tokens != sorted(set(tokens)) or tokens[0] <= 0 or any(s < 0 for _, s in value):
            raise ValueError("needs strictly increasing positive token counts with seconds >= 0")
        return value

    @field_validator("decode_step_s", mode="before")
    @classmethod
    def _split_decode(cls, value):
        return [part.strip() for part in value.split(",")] if isinstance(value, str) else value

    @field_validator("kvs_key_format")
    @classmethod
    def _known_key_format(cls, value: str) -> str:
        return check_key_format(value)

    @field_validator("hash_seed", mode="before")
    @classmethod
    def _empty_seed_is_zero(cls, value):
        # vLLM and Llumnix treat an unset or empty seed as "0".
        return value or "0"

    @field_validator("instance_networks")
    @classmethod
    def _valid_networks(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(network) for network in instance_rules.parse_networks(value))

    @field_validator("api_keys_file")
    @classmethod
    def _readable_api_keys(cls, value: str) -> str:
        if value:
            load_api_keys(value)
        return value

    @model_validator(mode="after")
    def _instances_in_allowed_networks(self) -> Settings:
        networks = instance_rules.parse_networks(self.instance_networks)
        for instance in self.instances:
            instance_rules.check_url_in_networks(instance.url, networks)
        return self

    @model_validator(mode="after")
    def _deprecated_and_implied(self) -> Settings:
        # Assigning inside the validator would re-run it (validate_assignment): write the dict.
        if self.prefill_tokens_per_s is not None and "ttft_prefill_points" not in self.model_fields_set:
            rate = self.prefill_tokens_per_s
            self.__dict__["ttft_prefill_points"] = ((1, 1 / rate), (1_000_000, 1_000_000 / rate))
        if self.ttft_slo_s > 0 and "early_rejection" not in self.model_fields_set:
            self.__dict__["early_rejection"] = EarlyRejection.EARLY
        if self.api_keys_file and "debug_routes" not in self.model_fields_set:
            self.__dict__["debug_routes"] = DebugRoutes.ADMIN
        return self

    @model_validator(mode="after")
    def _unique_instance_ids(self) -> Settings:
        ids = [inst.id for inst in self.instances]
        duplicated = sorted({i for i in ids if ids.count(i) > 1})
        if duplicated:
            raise ValueError(f"instances: duplicated id(s) {duplicated}")
        instance_rules.check_lora_adapters(self.instances)
        return self

    @model_validator(mode="after")
    def _discovery_source_named(self) -> Settings:
        if self.discovery == DiscoveryName.FILE and not self.discovery_file:
            raise ValueError("discovery file needs discovery_file")
        if self.discovery == DiscoveryName.KUBERNETES and (
            bool(self.discovery_label_selector) == bool(self.discovery_inference_pool)
        ):
            raise ValueError("discovery kubernetes needs one of discovery_label_selector or discovery_inference_pool")
        return self

    @model_validator(mode="after")
    def _account_sync_url(self) -> Settings:
        if self.account_sync and not self.account_sync.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("account_sync: expected a redis://, rediss:// or unix:// URL")
        if self.account_sync and self.account_sync_ttl_s <= 2 * self.account_sync_interval_s:
            raise ValueError("account_sync_ttl_s must exceed twice account_sync_interval_s")
        return self

    @field_validator("kvs_conductor_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("expected an http:// or https:// URL")
        return value.rstrip("/")

    @model_validator(mode="after")
    def _kv_events_consistent(self) -> Settings:
        publishing = any(instance.kv_events_endpoint for instance in self.instances)
        if (publishing or self.kvs_backend == KVSBackendName.KV_EVENTS) and self.kvs_hash_algo != HashAlgo.SHA256_CBOR:
            raise ValueError("KV events carry vLLM's block hashes: they need kvs_hash_algo sha256_cbor")
        return self

    @model_validator(mode="after")
    def _valid_pd_fleet(self) -> Settings:
        check_pd_fleet(self.instances, self.pd_protocol, self.pd_skip_prefill_below_tokens)
        return self

    @property
    def effective_policy(self) -> str:
        """The Llumnix switch upgrades least_load to cache_aware; other policies are explicit."""
        if self.enable_cache_aware_scheduling and self.dispatch_policy == "least_load":
            return "cache_aware"
        return self.dispatch_policy
