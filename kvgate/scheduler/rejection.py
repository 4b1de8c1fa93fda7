"""Early rejection, a pure filter after the decision: answer 429 at once what would miss the SLOs.

Modes (`--early-rejection`, REFERENCE.md section 5):
- none: admit everything.
- early: reject when the chosen instance's predicted TTFT exceeds `--ttft-slo-s`, or when a
  decode step *now* - the decode batch plus this request, and a prefill chunk
  (`--prefill-chunk-tokens`) when prefills are queued there - would be slower than `--tbt-slo-s`.
- predictive: the same TTFT test; the decode step is judged at the moment this request would
  start decoding (now + its predicted TTFT): requests still in prefill there join the batch, and
  of the requests decoding now those whose decode ends before then leave. Decode ages are taken
  as uniform over one mean decode time (mean output tokens x step time), as in the Mooncake
  paper: the fraction gone after t is t / decode time. The prefill queued now is ahead of this
  request (first come, first served), so it is done by then and adds no chunk. Judging the
  future batch instead of the present one damps the oscillation plain early rejection causes
  (reject while a wave prefills, then admit a wave that all reaches decode together).

The decode load is the one of the instance that will decode: the selected instance in a fleet of
whole-request instances; a prefill/decode split passes its decode choice's load (`decode_load`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvgate.config.settings import EarlyRejection
from kvgate.scheduler.ttft import TTFTModel
from kvgate.scheduler.types import InstanceLoad, TTFTPrediction


@dataclass(frozen=True, slots=True)
class Rejection:
    code: str  # "ttft_slo_exceeded" | "tbt_slo_exceeded"
    message: str
    retry_after_s: int  # whole seconds, for the Retry-After header


@dataclass(frozen=True, slots=True)
class DecodeOutlook:
    """The decode batch the request would join and the step time predicted for it."""

    batch: float
    step_s: float


class RejectionFilter:
    def __init__(self, mode: EarlyRejection, ttft_slo_s: float, tbt_slo_s: float) -> None:
        self.mode = mode
        self.ttft_slo_s = ttft_slo_s
        self.tbt_slo_s = tbt_slo_s

    @property
    def active(self) -> bool:
        return self.mode != EarlyRejection.NONE and (self.ttft_slo_s > 0 or self.tbt_slo_s > 0)

    def judge(self, prediction: TTFTPrediction, decode_load: InstanceLoad, model: TTFTModel) -> Rejection | None:
        if not self.active:
            return None
        ttft = prediction.predicted_ttft_s
        if self.ttft_slo_s > 0 and ttft > self.ttft_slo_s:
            return Rejection(
                "ttft_slo_exceeded",
                f"overloaded: predicted time to first token {ttft:.2f}s exceeds the {self.ttft_slo_s:g}s SLO; "
                "retry later",
                _whole_seconds(ttft - self.ttft_slo_s),
            )
        if self.tbt_slo_s > 0:
            outlook = self.decode_outlook(ttft, decode_load, model)
            if outlook.step_s > self.tbt_slo_s:
                return Rejection(
                    "tbt_slo_exceeded",
                    f"overloaded: predicted time between tokens {outlook.step_s * 1000:.1f}ms exceeds the "
                    f"{self.tbt_slo_s * 1000:g}ms SLO; retry later",
                    _whole_seconds(self._decode_time_s(decode_load, model)),
                )
        return None

    def decode_outlook(self, ttft_s: float, load: InstanceLoad, model: TTFTModel) -> DecodeOutlook:
        profile = model.profile
        context = model.mean_prompt_tokens + model.mean_output_tokens / 2
        prefilling = load.num_waiting_requests
        decoding = max(0, load.num_requests - prefilling)
        if self.mode == EarlyRejection.PREDICTIVE:
            decode_time = self._decode_time_s(load, model)
            leaving = min(1.0, ttft_s / decode_time) if decode_time > 0 else 1.0
            batch = decoding * (1.0 - leaving) + prefilling + 1
            return DecodeOutlook(batch, profile.decode_step_s(batch, context))
        batch = decoding + 1
        prefills_queued = load.all_prefills_tokens_num > 0 or prefilling > 0
        return DecodeOutlook(batch, profile.decode_step_s(batch, context, prefills_queued))

    @staticmethod
    def _decode_time_s(load: InstanceLoad, model: TTFTModel) -> float:
        """How long a mean request decodes at the batch running now."""
        decoding = max(1, load.num_requests - load.num_waiting_requests)
        context = model.mean_prompt_tokens + model.mean_output_tokens / 2
        return model.mean_output_tokens * model.profile.decode_step_s(decoding, context)


def _whole_seconds(seconds: float) -> int:
    return max(1, math.ceil(seconds))
