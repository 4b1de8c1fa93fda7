"""The one TTFT model: predicted TTFT = T_queue + T_prefill + T_transfer (REFERENCE.md section 5).

- T_prefill prices the tokens the instance must compute, given the prefix already present, on the
  profile's prefill curve.
- T_transfer prices the tokens it loads from other segments (network bandwidth) or disk tiers
  (disk bandwidth) at the model's KV bytes per token. Its own segment counts as its prefix cache;
  blocks its own engine holds in a CPU or storage tier (KV events) load at host or disk bandwidth.
- T_queue prices the prefill work queued there (the dispatch account's uncomputed tokens, which
  already merges what the engine reports) on the same curve, at the mean prompt's cost per token.
  Work done since dispatch leaves the account at each first token (a request at a time): the
  engines compute several prefills at once (chunked prefill), so subtracting the time elapsed
  since the last first token overstated progress and measured worse in simulation.
- Both compute terms include the instance's decode batch: every chunked-prefill step also carries
  one token of each running decode (the curve is an idle engine's), priced from --decode-step-s.
- Which prefix: Conductor's rule. The pool's longer prefix is loaded only when it is
  `kvcache_balancing_threshold` times the local one or more; otherwise the rest is computed.

Calibration (`calibration.py`) scales compute (queue + prefill) and transfer per instance from
measured TTFTs, so a deployment that never profiled converges. The policy (`conductor`), the
rejection filter, the simulator and /debug/schedule all read predictions from here.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvgate.config.settings import Settings
from kvgate.scheduler.calibration import Calibration
from kvgate.scheduler.prefill_curve import PrefillCurve
from kvgate.scheduler.tiers import TieredHits
from kvgate.scheduler.types import Candidate, TTFTPrediction

_GB = 1e9
# Weight of one request in the running means of prompt and output lengths.
_MEAN_WEIGHT = 0.02


@dataclass(frozen=True, slots=True)
class TTFTProfile:
    """What the model knows about the hardware (config: --ttft-prefill-points, --kv-*)."""

    prefill: PrefillCurve
    kv_bytes_per_token: int
    network_bytes_per_s: float
    disk_bytes_per_s: float
    # Decode step = base + per_sequence * batch + per_context_token * context tokens.
    decode_base_s: float
    decode_per_sequence_s: float
    decode_per_context_token_s: float
    prefill_chunk_tokens: int = 2048
    balancing_threshold: float = 1.0
    host_bytes_per_s: float = 50 * _GB

    @classmethod
    def from_settings(cls, settings: Settings) -> TTFTProfile:
        base, per_sequence, per_token = settings.decode_step_s
        return cls(
            PrefillCurve(settings.ttft_prefill_points),
            settings.kv_bytes_per_token,
            settings.kv_network_bandwidth_gb_s * _GB,
            settings.kv_disk_bandwidth_gb_s * _GB,
            base,
            per_sequence,
            per_token,
            settings.prefill_chunk_tokens,
            settings.kvcache_balancing_threshold,
            settings.kv_host_bandwidth_gb_s * _GB,
        )

    def decode_step_s(self, batch: float, mean_context_tokens: float, with_prefill_chunk: bool = False) -> float:
        """One decode step; with a prefill chunk in the same batch (an instance that also prefills)."""
        step = (
            self.decode_base_s
            + self.decode_per_sequence_s * batch
            + self.decode_per_context_token_s * batch * mean_context_tokens
        )
        if with_prefill_chunk:
            step += self.prefill.chunk_s(int(mean_context_tokens / 2), self.prefill_chunk_tokens)
        return step


class TTFTModel:
    """Profile + per-instance calibration + running means of the traffic. Pure: state changes
    only through observe_request / observe_ttft / forget."""

    def __init__(self, profile: TTFTProfile, calibrate: bool = True) -> None:
        self.profile = profile
        self.calibration = Calibration(enabled=calibrate)
        # Running means of the traffic, for the queue price and the decode model.
        self.mean_prompt_tokens = 4096.0
        self.mean_output_tokens = 256.0

    def predict(
        self,
        candidate: Candidate,
        num_prompt_tokens: int,
        hits: TieredHits,
    ) -> TTFTPrediction:
        profile = self.profile
        instance_id = candidate.id
        local = hits.local.get(instance_id, 0)
        prefix, network, disk = local, 0, 0
        if hits.pool_tokens > local and hits.pool_tokens >= local * profile.balancing_threshold:
            prefix = hits.pool_tokens
            network, disk = hits.transfer_tokens(instance_id)
        # A fully cached prompt still computes its last token (to produce logits): not loaded either.
        excess = max(0, prefix - max(num_prompt_tokens - 1, 0))
        if excess:
            prefix -= excess
            cut = min(excess, network)
            network, disk = network - cut, max(0, disk - (excess - cut))
        computed = num_prompt_tokens - prefix
        prefill = profile.prefill.chunk_s(prefix, computed) + self.decode_share_s(candidate, computed)
        host, own_disk = hits.own_tier_tokens(instance_id)
        disk += own_disk
        transfer = (
            network / profile.network_bytes_per_s + disk / profile.disk_bytes_per_s + host / profile.host_bytes_per_s
        ) * profile.kv_bytes_per_token
        queue = self.queue_s(candidate)
        compute_factor, transfer_factor = self.calibration.factors(instance_id)
        return TTFTPrediction(
            instance_id,
            compute_factor * (queue + prefill) + transfer_factor * transfer,
            compute_factor * queue,
            compute_factor * prefill,
            transfer_factor * transfer,
            network + disk + host,
            local,
            queue + prefill,
            transfer,
        )

    def queue_s(self, candidate: Candidate) -> float:
        """Uncalibrated seconds of prefill queued on the instance ahead of a new request."""
        queued_tokens = candidate.load.all_prefills_tokens_num
        if queued_tokens <= 0:
            return 0.0
        return (queued_tokens * self.profile.prefill.per_token_s(self.mean_prompt_tokens)
                + self.decode_share_s(candidate, queued_tokens))

    def decode_share_s(self, candidate: Candidate, prefill_tokens: int) -> float:
        """What the instance's decode batch adds to the steps that prefill `prefill_tokens`: every
        step of a chunked prefill also carries one token of each running decode (the curve is
        measured on an idle engine)."""
        load = candidate.load
        decoding = load.num_requests - load.num_waiting_requests
        if decoding <= 0 or prefill_tokens <= 0:
            return 0.0
        profile = self.profile
        context = self.mean_prompt_tokens + self.mean_output_tokens / 2
        per_step = profile.decode_step_s(decoding, context) - profile.decode_base_s
        return per_step * prefill_tokens / profile.prefill_chunk_tokens

    # --- what happened ---

    def observe_request(self, num_prompt_tokens: int, max_tokens: int | None) -> None:
        """A dispatched request, for the running means of prompt and output lengths."""
        self.mean_prompt_tokens += _MEAN_WEIGHT * (num_prompt_tokens - self.mean_prompt_tokens)
        if max_tokens is not None:
            self.mean_output_tokens += _MEAN_WEIGHT * (max_tokens - self.mean_output_tokens)

    def observe_ttft(self, prediction: TTFTPrediction, measured_s: float) -> float:
        """A measured TTFT (first byte minus dispatch) for a prediction; returns measured - predicted."""
        self.calibration.observe(prediction.instance_id, prediction.raw_compute_s, prediction.raw_transfer_s,
                                 measured_s)
        return measured_s - prediction.predicted_ttft_s

    def forget(self, instance_ids: Sequence[str]) -> None:
        """Instances removed: their clocks and calibration go with them."""
        for instance_id in instance_ids:
            self.calibration.forget(instance_id)


class Predictions(Mapping[str, TTFTPrediction]):
    """Every candidate's prediction for one request, computed when first read (the winner's alone
    is what most requests need)."""

    __slots__ = ("_model", "_candidate_list", "_by_id", "_num_prompt_tokens", "_pool", "_hits", "_cache")

    def __init__(
        self,
        model: TTFTModel,
        candidates: Sequence[Candidate],
        num_prompt_tokens: int,
        pool: Callable[[], TieredHits],
    ) -> None:
        self._model = model
        self._candidate_list = candidates
        self._by_id: dict[str, Candidate] | None = None  # built on first read: most reads are one
        self._num_prompt_tokens = num_prompt_tokens
        self._pool = pool  # builds the tiered view on first use
        self._hits: TieredHits | None = None
        self._cache: dict[str, TTFTPrediction] = {}

    @property
    def hits(self) -> TieredHits:
        if self._hits is None:
            self._hits = self._pool()
        return self._hits

    def __getitem__(self, instance_id: str) -> TTFTPrediction:
        prediction = self._cache.get(instance_id)
        if prediction is None:
            prediction = self._cache[instance_id] = self._model.predict(
                self._candidates()[instance_id], self._num_prompt_tokens, self.hits
            )
        return prediction

    def _candidates(self) -> dict[str, Candidate]:
        if self._by_id is None:
            self._by_id = {candidate.id: candidate for candidate in self._candidate_list}
        return self._by_id

    def __iter__(self):
        return iter(self._candidates())

    def __len__(self) -> int:
        return len(self._candidate_list)
