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

from kvgate.config.key_formats import check_key_format


class KVSBackendName(StrEnum):
    MOONCAKE = "mooncake"
    REDIS = "redis"
    EMBEDDED = "embedded"


class HashAlgo(StrEnum):
    SHA256_CBOR = "sha256_cbor"
    SHA256_HEX = "sha256_hex"
    XXHASH = "xxhash"


class InstanceRole(StrEnum):
    NEUTRAL = "neutral"
    PREFILL = "prefill"
    DECODE = "decode"


# The default --dispatch-metric-order. Policy and metric names are checked against the scheduler's
# registry (kvgate/scheduler/registry.py), the one place they are listed.
DEFAULT_METRIC_ORDER = (
    "all_prefills_tokens_num",
    "num_waiting_requests",
    "num_requests",
    "kv_cache_usage_ratio",
)


class EarlyRejection(StrEnum):
    NONE = "none"
    EARLY = "early"
    PREDICTIVE = "predictive"


class InstanceConfig(BaseModel):
    """One engine instance behind the gateway."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, Field(min_length=1)]
    url: Annotated[str, Field(pattern=r"^https?://")]
    model: Annotated[str, Field(min_length=1)]
    role: InstanceRole = InstanceRole.NEUTRAL
    # IPs or IP:port that hold this instance's KV cache in the store (Mooncake transport endpoints).
    kvs_endpoints: tuple[str, ...] = ()


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
        False, description="Also report blocks on Mooncake's disk tiers (local SSD, NVMe-oF, shared storage)."
    )

    # --- gateway ---
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    tokenizer: str = Field("", description="Local directory or name of a Hugging Face tokenizer (offline).")
    chat_template: str = Field("", description="Jinja chat template file overriding the tokenizer's.")
    tokenize_cache_size: int = Field(4096, ge=0, description="Prefix-aware tokenize cache entries.")
    max_body_bytes: int = Field(8 * 1024 * 1024, ge=1024)
    forward_retries: int = Field(2, ge=0, description="Retries on the next-best instance before the first byte.")
    upstream_connect_timeout_s: float = Field(3.0, gt=0)
    upstream_read_timeout_s: float = Field(600.0, gt=0)
    health_check_interval_s: float = Field(2.0, gt=0)
    health_check_failures_to_eject: int = Field(2, ge=1)
    stats_poll_interval_s: float = Field(1.0, gt=0)
    admin_token: str = Field("", description="Bearer token for /admin routes; empty disables them.")
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
        1.0, description="conductor: load a longer prefix from another segment only when it is this "
        "many times the local one (Mooncake Conductor's kvcache_balancing_threshold); >= 1.",
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

    instances: tuple[InstanceConfig, ...] = ()

    @field_validator("dispatch_metric_order", mode="before")
    @classmethod
    def _split_metric_order(cls, value):
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

    @model_validator(mode="after")
    def _deprecated_and_implied(self) -> Settings:
        # Assigning inside the validator would re-run it (validate_assignment): write the dict.
        if self.prefill_tokens_per_s is not None and "ttft_prefill_points" not in self.model_fields_set:
            rate = self.prefill_tokens_per_s
            self.__dict__["ttft_prefill_points"] = ((1, 1 / rate), (1_000_000, 1_000_000 / rate))
        if self.ttft_slo_s > 0 and "early_rejection" not in self.model_fields_set:
            self.__dict__["early_rejection"] = EarlyRejection.EARLY
        return self

    @model_validator(mode="after")
    def _unique_instance_ids(self) -> Settings:
        ids = [inst.id for inst in self.instances]
        duplicated = sorted({i for i in ids if ids.count(i) > 1})
        if duplicated:
            raise ValueError(f"instances: duplicated id(s) {duplicated}")
        return self

    @property
    def effective_policy(self) -> str:
        """The Llumnix switch upgrades least_load to cache_aware; other policies are explicit."""
        if self.enable_cache_aware_scheduling and self.dispatch_policy == "least_load":
            return "cache_aware"
        return self.dispatch_policy
