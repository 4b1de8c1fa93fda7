"""The PrfaaS throughput model and the grid search that sizes a deployment with it.

A remote cluster of `N_r` prefill-only instances takes every request whose prompt is longer than a
threshold `t` and ships its KV cache over a link of `B` bytes/s; the local PD cluster of `N`
instances splits into `N_p` prefill and `N_d = N - N_p` decode instances. With `p = P(l > t)`:

    Θ_prfaas = min(N_r / E[T_r(l) | l > t],  B / E[S_kv(l) | l > t])   long requests/s
    Θ_pd-p   = N_p / E[T_p(l) | l <= t]                                  short requests/s
    Θ_pd-d   = N_d * BS_max / (T_decode * L_out)                         requests/s
    Λ_max    = min(Θ_prfaas / p,  Θ_pd-p / (1 - p),  Θ_pd-d)

Expectations over the length distribution (not the profile at the mean length): a pool of servers
drains requests at N / E[service time]. A term whose share of requests is zero does not bound Λ.
The search tries every threshold between two distinct lengths of the distribution (plus "all" and
"none") and every split with at least one decode instance, and keeps the highest Λ_max; among equal
Λ_max (a plateau where decode binds) the one with the most prefill headroom on the tighter side, the
balance point the paper names, then the one with the least egress.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from kvgate.planner.workload import LengthDistribution
from kvgate.scheduler.length_profile import LengthProfile

MIB = 1 << 20
# Λ_max values closer than this (relative) are a tie, decided by headroom and then egress.
_TIE = 1e-9


@dataclass(frozen=True)
class Fleet:
    """What the model needs to know about the two clusters, the link and the model's outputs."""

    prfaas_instances: int
    prfaas_prefill_s: LengthProfile
    kv_size_mib: LengthProfile  # KV cache shipped per request, by prompt length
    egress_gbps: float
    local_instances: int
    local_prefill_s: LengthProfile
    decode_batch_size: int
    decode_step_s: float
    output_tokens: float

    @property
    def decode_rps_per_instance(self) -> float:
        return self.decode_batch_size / (self.decode_step_s * self.output_tokens)

    @property
    def egress_bytes_per_s(self) -> float:
        return self.egress_gbps * 1e9 / 8


@dataclass(frozen=True)
class OperatingPoint:
    """One configuration and what the model says of it. Θ terms are None where they bound nothing."""

    threshold_tokens: int | None  # None: nothing is offloaded
    n_prfaas: int
    n_prefill: int
    n_decode: int
    offload_fraction: float
    theta_prfaas_rps: float | None
    theta_pd_p_rps: float | None
    theta_pd_d_rps: float
    lambda_max_rps: float
    egress_gbps: float
    bottleneck: str

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    best: OperatingPoint
    homogeneous_pd: OperatingPoint
    naive_heterogeneous: OperatingPoint


class _Sums:
    """Per-request work summed over lengths up to each point, so any threshold costs O(1)."""

    def __init__(self, fleet: Fleet, dist: LengthDistribution) -> None:
        w = dist.weights
        mass = np.cumsum(w)
        # Normalised so "everything offloaded" is exactly 1, not 1 - 1e-16.
        self.mass = np.concatenate([[0.0], mass / mass[-1]])
        self.local_s = np.concatenate([[0.0], np.cumsum(w * fleet.local_prefill_s.at(dist.lengths))])
        self.remote_s = np.concatenate([[0.0], np.cumsum(w * fleet.prfaas_prefill_s.at(dist.lengths))])
        self.kv_mib = np.concatenate([[0.0], np.cumsum(w * fleet.kv_size_mib.at(dist.lengths))])
        # Cut k keeps the first k lengths local and offloads the rest: threshold = the k-th length.
        self.thresholds = np.concatenate([[0.0], dist.lengths])
        self.none_offloaded = len(dist.lengths)


@dataclass(frozen=True)
class _Grid:
    """The model at many cuts for one local split, as arrays (bounds in requests/s of all traffic)."""

    cuts: np.ndarray
    n_prefill: int
    n_decode: int
    offloaded: np.ndarray
    kept_local: np.ndarray
    bounds: np.ndarray  # rows in the order of _BOUND_NAMES
    long_mib: np.ndarray

    @property
    def lam(self) -> np.ndarray:
        return self.bounds.min(axis=0)

    @property
    def egress_gbps(self) -> np.ndarray:
        return self.lam * self.long_mib * MIB * 8 / 1e9

    @property
    def prefill_headroom(self) -> np.ndarray:
        """The tighter prefill side's bound (remote compute or link, or local), for tie-breaking."""
        return self.bounds[:3].min(axis=0)


_BOUND_NAMES = ("prfaas prefill", "egress link", "local prefill", "local decode")


def plan(fleet: Fleet, dist: LengthDistribution) -> Plan:
    """The best PrfaaS configuration and the two baselines, for this fleet and workload."""
    if fleet.local_instances < 2:
        raise ValueError("the local PD cluster needs at least 2 instances (one prefill, one decode)")
    sums = _Sums(fleet, dist)
    nothing = np.array([sums.none_offloaded])
    homogeneous = max(
        (_point(fleet, sums, _grid(fleet, sums, nothing, n_p), 0) for n_p in range(1, fleet.local_instances)),
        key=lambda point: point.lambda_max_rps,
    )
    naive = _point(fleet, sums, _grid(fleet, sums, np.array([0]), 0), 0)
    every_cut = np.arange(sums.none_offloaded + 1)
    splits = range(fleet.local_instances)
    # Two passes, one grid in memory at a time whatever N: the highest Λ_max, then its ties.
    top = max(float(_grid(fleet, sums, every_cut, n_p).lam.max()) for n_p in splits)
    best_key, best = None, None
    for n_p in splits:
        grid = _grid(fleet, sums, every_cut, n_p)
        for i in np.flatnonzero(grid.lam >= top * (1 - _TIE)):
            key = (float(grid.prefill_headroom[i]), -float(grid.egress_gbps[i]))
            if best_key is None or key > best_key:
                best_key, best = key, _point(fleet, sums, grid, int(i))
    assert best is not None
    return Plan(best, homogeneous, naive)


def evaluate(
    fleet: Fleet, dist: LengthDistribution, threshold_tokens: float | None, n_prefill: int
) -> OperatingPoint:
    """The model at one configuration: offload prompts longer than `threshold_tokens` (None: none)."""
    if not 0 <= n_prefill < fleet.local_instances:
        raise ValueError(f"n_prefill must be in [0, {fleet.local_instances - 1}]")
    sums = _Sums(fleet, dist)
    if threshold_tokens is None:
        cut = sums.none_offloaded
    else:
        cut = int(np.searchsorted(dist.lengths, threshold_tokens, side="right"))
    point = _point(fleet, sums, _grid(fleet, sums, np.array([cut]), n_prefill), 0)
    if threshold_tokens is None or cut == sums.none_offloaded:
        return point
    return OperatingPoint(**{**point.to_dict(), "threshold_tokens": int(threshold_tokens)})


def _grid(fleet: Fleet, sums: _Sums, cuts: np.ndarray, n_prefill: int) -> _Grid:
    short_mass, short_s = sums.mass[cuts], sums.local_s[cuts]
    long_mass = 1.0 - short_mass
    long_s = sums.remote_s[-1] - sums.remote_s[cuts]
    long_mib = sums.kv_mib[-1] - sums.kv_mib[cuts]
    with np.errstate(divide="ignore", invalid="ignore"):
        # Θ / share = N / (share * E[work | side]) = N / (work summed over that side's lengths).
        remote = np.where(long_mass > 0, fleet.prfaas_instances / long_s, np.inf)
        link = np.where(long_mass > 0, fleet.egress_bytes_per_s / (long_mib * MIB), np.inf)
        local = np.where(short_mass > 0, n_prefill / short_s, np.inf)
    n_decode = fleet.local_instances - n_prefill
    decode = np.full(len(cuts), n_decode * fleet.decode_rps_per_instance)
    bounds = np.stack([remote, link, local, decode])
    return _Grid(cuts, n_prefill, n_decode, long_mass, short_mass, bounds, long_mib)


def _point(fleet: Fleet, sums: _Sums, grid: _Grid, i: int) -> OperatingPoint:
    cut, offloaded, kept = int(grid.cuts[i]), float(grid.offloaded[i]), float(grid.kept_local[i])
    remote, link, local, decode = (float(b) for b in grid.bounds[:, i])
    return OperatingPoint(
        threshold_tokens=None if cut == sums.none_offloaded else int(round(sums.thresholds[cut])),
        n_prfaas=fleet.prfaas_instances if offloaded > 0 else 0,
        n_prefill=grid.n_prefill,
        n_decode=grid.n_decode,
        offload_fraction=offloaded,
        theta_prfaas_rps=min(remote, link) * offloaded if offloaded > 0 else None,
        theta_pd_p_rps=local * kept if kept > 0 else None,
        theta_pd_d_rps=decode,
        lambda_max_rps=float(grid.lam[i]),
        egress_gbps=float(grid.egress_gbps[i]),
        bottleneck=_BOUND_NAMES[int(grid.bounds[:, i].argmin())],
    )
