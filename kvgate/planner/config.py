"""The planner's input file: the two clusters' profiles, the link and the workload (YAML).

Its own small schema, apart from the gateway's Settings: a plan describes hardware that may not
exist yet. Relative trace paths are read from the config file's directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvgate.planner.model import Fleet
from kvgate.planner.workload import LengthDistribution, trace_lengths, truncated_lognormal
from kvgate.scheduler.length_profile import LengthProfile

PositiveInt = Annotated[int, Field(ge=1)]
# {prompt length in tokens: value}; at least two lengths so the profile can be interpolated.
LengthTable = Annotated[dict[PositiveInt, Annotated[float, Field(ge=0)]], Field(min_length=2)]


class PlanConfigError(ValueError):
    """A planner config that cannot be used; str() names the file and the offending key."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrfaasCluster(_Strict):
    instances: PositiveInt
    prefill_latency_s: LengthTable
    kv_size_mib: LengthTable  # KV cache (and recurrent state) one request ships, by prompt length
    egress_gbps: Annotated[float, Field(gt=0)]


class Decode(_Strict):
    batch_size: PositiveInt  # BS_max: requests decoding at once on one instance
    step_time_s: Annotated[float, Field(gt=0)]  # T_decode: one decode step at that batch


class LocalCluster(_Strict):
    # Every split is searched: the bound keeps a typo (a GPU count for an instance count) from
    # turning the search into minutes.
    instances: Annotated[int, Field(ge=2, le=4096)]
    prefill_latency_s: LengthTable
    decode: Decode


class LogNormal(_Strict):
    mu: float
    sigma: Annotated[float, Field(gt=0)]
    min: Annotated[float, Field(ge=1)]
    max: float

    @model_validator(mode="after")
    def _ordered(self) -> LogNormal:
        if self.max <= self.min:
            raise ValueError("max must be greater than min")
        return self


class InputLength(_Strict):
    lognormal: LogNormal | None = None
    trace: str | None = None  # Mooncake-format JSON lines: the prompts' input_length

    @model_validator(mode="after")
    def _exactly_one(self) -> InputLength:
        if (self.lognormal is None) == (self.trace is None):
            raise ValueError("give exactly one of lognormal or trace")
        return self


class Workload(_Strict):
    input_length: InputLength
    output_tokens: PositiveInt | None = None  # L_out; default: the trace's mean output length


class PlanConfig(_Strict):
    name: str = ""
    prfaas: PrfaasCluster
    local: LocalCluster
    workload: Workload

    @model_validator(mode="after")
    def _output_known(self) -> PlanConfig:
        if self.workload.output_tokens is None and self.workload.input_length.trace is None:
            raise ValueError("workload.output_tokens is required unless input_length is a trace")
        return self


def load_plan(path: str | Path, trace: str | None = None) -> tuple[PlanConfig, Fleet, LengthDistribution]:
    """Read and check a planner config; raises PlanConfigError with a message naming the key.

    `trace` (a path as given on the command line) replaces the file's workload: input lengths and
    output tokens both come from the trace.
    """
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise PlanConfigError(f"{path}: cannot read: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise PlanConfigError(f"{path}: invalid YAML: {exc}") from None
    try:
        config = PlanConfig.model_validate(raw)
    except ValidationError as exc:
        lines = [f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors()]
        raise PlanConfigError(f"{path}: invalid planner config:\n  " + "\n  ".join(lines)) from None
    length = config.workload.input_length
    output_tokens = config.workload.output_tokens
    try:
        if trace is not None:
            dist, mean_output = trace_lengths(trace)
            output_tokens = None
        elif length.trace is not None:
            dist, mean_output = trace_lengths(path.parent / length.trace)
        else:
            ln = length.lognormal
            assert ln is not None
            dist, mean_output = truncated_lognormal(ln.mu, ln.sigma, ln.min, ln.max), 0.0
    except ValueError as exc:  # TraceError is a ValueError
        raise PlanConfigError(f"{trace or path}: workload.input_length: {exc}") from None
    fleet = Fleet(
        prfaas_instances=config.prfaas.instances,
        prfaas_prefill_s=LengthProfile.from_points(config.prfaas.prefill_latency_s),
        kv_size_mib=LengthProfile.from_points(config.prfaas.kv_size_mib),
        egress_gbps=config.prfaas.egress_gbps,
        local_instances=config.local.instances,
        local_prefill_s=LengthProfile.from_points(config.local.prefill_latency_s),
        decode_batch_size=config.local.decode.batch_size,
        decode_step_s=config.local.decode.step_time_s,
        output_tokens=float(output_tokens or mean_output),
    )
    return config, fleet, dist
