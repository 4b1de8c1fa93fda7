"""Plain data the scheduler works on. No I/O: the gateway and the simulator fill these in."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from kvgate.config.settings import InstanceRole


@dataclass(slots=True)
class InstanceLoad:
    """An instance's load as the selector sees it: engine stats merged with the dispatch account."""

    num_requests: int = 0
    num_waiting_requests: int = 0
    # Uncomputed prompt tokens queued for prefill there (engine-reported + dispatched, not yet seen).
    all_prefills_tokens_num: int = 0
    kv_cache_usage_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """What an engine reports about itself (its Prometheus gauges), before merging with the account."""

    num_running: int
    num_waiting: int
    kv_cache_usage_ratio: float


@dataclass(frozen=True, slots=True)
class Candidate:
    """An instance the request may go to."""

    id: str
    role: InstanceRole
    load: InstanceLoad


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """What a policy needs to know about one request."""

    num_prompt_tokens: int
    # Contiguous-from-chunk-0 hit tokens per instance id; an instance absent here has no hit.
    prefix_hit_tokens: Mapping[str, int] = field(default_factory=dict)
    # Predicted TTFT per candidate id (ttft.Predictions, computed when read); None when not needed.
    predictions: Mapping[str, TTFTPrediction] | None = None
    # The debug route's planning: rank exactly as a real request would, but leave the selector's
    # tie cursor and random state where they are, so looking never changes what traffic gets.
    dry_run: bool = False


@dataclass(frozen=True, slots=True)
class InstanceScore:
    """Why an instance ranked where it did (what /debug/schedule shows)."""

    id: str
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    metrics: dict[str, float]


@dataclass(frozen=True, slots=True)
class Decision:
    """The chosen instance and the full ranking (retries walk it in order)."""

    selected: str | None
    # Best first. A sequence rather than a tuple: past the winner it is sorted only when read.
    ranking: Sequence[str]
    # One per candidate, in ranking order. A sequence rather than a tuple so the selector can build
    # the entries only when read: most decisions read the winner's score alone.
    scores: Sequence[InstanceScore]
    cache_aware: bool
    # Predicted TTFT per candidate id (ttft.Predictions, computed when read).
    predictions: Mapping[str, TTFTPrediction] | None = None


@dataclass(frozen=True, slots=True)
class TTFTPrediction:
    """One instance's predicted TTFT and its terms (calibrated: they sum to predicted_ttft_s)."""

    instance_id: str
    predicted_ttft_s: float
    queue_s: float
    prefill_s: float
    transfer_s: float
    transfer_tokens: int  # loaded from other segments, disk tiers or its own engine's CPU tier
    local_hit_tokens: int
    # Before calibration, for the calibration.
    raw_compute_s: float  # queue + prefill
    raw_transfer_s: float
