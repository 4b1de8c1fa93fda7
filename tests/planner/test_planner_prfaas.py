"""`kvgate plan prfaas`: the throughput model against hand-worked cases, the CLI's JSON, bad configs."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from kvgate.planner.config import PlanConfigError, load_plan
from kvgate.planner.model import MIB, evaluate, plan
from kvgate.planner.workload import truncated_lognormal
from kvgate.scheduler.length_profile import LengthProfile
from tests.trace_helpers import row, write_trace

REPO = Path(__file__).resolve().parents[2]
CASE_STUDY = REPO / "deploy" / "plan-prfaas-case-study.yaml"


def _trace(tmp_path: Path) -> str:
    """Two prompts, 1000 and 3000 tokens, equally likely; 100 output tokens each."""
    rows = [row(0, [1, 2], input_length=1000, output_length=100), row(10, [3, 4, 5, 6, 7, 8], 3000, 100)]
    return write_trace(tmp_path / "two.jsonl", rows)


def _config(tmp_path: Path, **overrides) -> dict:
    """The hand-worked fleet: remote prefill 1 s at 1000 tokens and 2 s at 3000; local twice as slow;
    KV 100/300 MiB; decode 15 requests x 0.1 s steps x 100 tokens = 1.5 requests/s per instance."""
    config = {
        "name": "hand",
        "prfaas": {
            "instances": 2,
            "prefill_latency_s": {1000: 1.0, 3000: 2.0},
            "kv_size_mib": {1000: 100, 3000: 300},
            "egress_gbps": 1000,
        },
        "local": {
            "instances": 3,
            "prefill_latency_s": {1000: 2.0, 3000: 4.0},
            "decode": {"batch_size": 15, "step_time_s": 0.1},
        },
        "workload": {"input_length": {"trace": _trace(tmp_path)}},
    }
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = config
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return config


def _write(tmp_path: Path, config: dict, name: str = "plan.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "plan", "prfaas", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- profile interpolation and the length distribution ---


def test_profile_interpolates_inside_and_extends_end_segments_floored_at_zero():
    profile = LengthProfile.from_points({1000: 1.0, 3000: 2.0, 7000: 4.0})
    assert profile.at(np.array([1000, 2000, 5000, 7000])) == pytest.approx([1.0, 1.5, 3.0, 4.0])
    # Beyond the ends the first and last segments go on: 0.5 s/1000 tokens on both sides here.
    assert profile.at(np.array([0, 9000])) == pytest.approx([0.5, 5.0])
    steep = LengthProfile.from_points({1000: 0.1, 2000: 1.1})
    assert steep.at(np.array([0, 500])) == pytest.approx([0.0, 0.0])


@pytest.mark.parametrize("points", [{1000: 1.0}, {0: 1.0, 10: 2.0}, {10: -1.0, 20: 1.0}])
def test_profile_rejects_too_few_or_invalid_points(points):
    with pytest.raises(ValueError):
        LengthProfile.from_points(points)


def test_truncated_lognormal_matches_its_closed_form():
    mu, sigma, low, high = 9.9, 1.0, 128.0, 131072.0
    dist = truncated_lognormal(mu, sigma, low, high)

    def phi(z):
        return 0.5 * math.erfc(-z / math.sqrt(2))

    a, b = math.log(low), math.log(high)
    mass = phi((b - mu) / sigma) - phi((a - mu) / sigma)
    mean = (
        math.exp(mu + sigma**2 / 2)
        * (phi((b - mu - sigma**2) / sigma) - phi((a - mu - sigma**2) / sigma))
        / mass
    )
    assert dist.weights.sum() == pytest.approx(1.0)
    assert dist.mean() == pytest.approx(mean, rel=1e-4)
    # The median of the untruncated log-normal, e^mu, with the mass above 128K cut off.
    above_median = (0.5 - (1 - phi((b - mu) / sigma))) / mass
    assert dist.share_above(math.exp(mu)) == pytest.approx(above_median, abs=1e-4)


# --- the throughput model, hand-worked ---


def test_homogeneous_and_naive_baselines_match_hand_arithmetic(tmp_path):
    _, fleet, dist = load_plan(_write(tmp_path, _config(tmp_path)))
    result = plan(fleet, dist)
    homogeneous = result.homogeneous_pd
    # Local: E[T] = (2 + 4) / 2 = 3 s. 1P2D: min(1/3, 3.0); 2P1D: min(2/3, 1.5) = 0.667, prefill-bound.
    assert (homogeneous.n_prefill, homogeneous.n_decode) == (2, 1)
    assert homogeneous.lambda_max_rps == pytest.approx(2 / 3)
    assert homogeneous.bottleneck == "local prefill"
    assert (homogeneous.threshold_tokens, homogeneous.offload_fraction, homogeneous.egress_gbps) == (
        None,
        0,
        0,
    )
    naive = result.naive_heterogeneous
    # Remote takes all: E[T] = 1.5 s on 2 instances -> 1.333 req/s; decode 3 x 1.5 = 4.5.
    assert (naive.n_prefill, naive.n_decode, naive.offload_fraction) == (0, 3, 1.0)
    assert naive.lambda_max_rps == pytest.approx(4 / 3)
    assert naive.bottleneck == "prfaas prefill"
    # Egress: 1.333 req/s x E[KV] 200 MiB.
    assert naive.egress_gbps == pytest.approx(4 / 3 * 200 * MIB * 8 / 1e9)


def test_best_configuration_offloads_the_long_prompt_and_balances_local_decode(tmp_path):
    _, fleet, dist = load_plan(_write(tmp_path, _config(tmp_path)))
    best = plan(fleet, dist).best
    # Offloading the 3000-token half: remote 2 / (0.5 x 2 s) = 2 req/s; 2P1D local: 2 / (0.5 x 2 s) = 2,
    # decode 1.5 -> 1.5 (1P2D would give local prefill 1). Nothing else reaches 1.5.
    assert best.threshold_tokens == 1000
    assert best.offload_fraction == pytest.approx(0.5)
    assert (best.n_prfaas, best.n_prefill, best.n_decode) == (2, 2, 1)
    assert best.lambda_max_rps == pytest.approx(1.5)
    assert best.bottleneck == "local decode"
    # Θ terms as the paper writes them: per side, in requests of that side.
    assert best.theta_prfaas_rps == pytest.approx(2 / 2.0)
    assert best.theta_pd_p_rps == pytest.approx(2 / 2.0)
    assert best.theta_pd_d_rps == pytest.approx(1.5)
    assert best.egress_gbps == pytest.approx(1.5 * 0.5 * 300 * MIB * 8 / 1e9)


def test_equal_prompts_are_never_split_and_equal_throughput_prefers_less_egress(tmp_path):
    rows = [row(0, [1, 2], 1000, 100), row(1, [3, 4], 1000, 100), row(2, [5, 6, 7, 8, 9, 10], 3000, 100)]
    trace = write_trace(tmp_path / "three.jsonl", rows)
    _, fleet, dist = load_plan(
        _write(tmp_path, _config(tmp_path, **{"workload.input_length": {"trace": trace}}))
    )
    assert list(dist.lengths) == [1000, 3000]
    assert list(dist.weights) == pytest.approx([2 / 3, 1 / 3])
    best = plan(fleet, dist).best
    # Offload all: 2 / (2/3 x 1 s + 1/3 x 2 s) = 1.5 req/s, shipping 166.7 MiB a request on average.
    # Offload the 3000s: remote 2 / (1/3 x 2) = 3, local 2P: 2 / (2/3 x 2) = 1.5, decode 1D: 1.5, so
    # 1.5 as well with 100 MiB a request: the tie goes to the smaller egress.
    assert (best.threshold_tokens, best.n_prefill, best.n_decode) == (1000, 2, 1)
    assert best.offload_fraction == pytest.approx(1 / 3)
    assert best.lambda_max_rps == pytest.approx(1.5)
    assert best.egress_gbps == pytest.approx(1.5 * 100 * MIB * 8 / 1e9)


def test_a_narrow_link_bounds_the_offload(tmp_path):
    # A link that carries exactly 1.2 offloaded-half requests/s: 1.2 x 150 MiB per request on average.
    link_gbps = 1.2 * 150 * MIB * 8 / 1e9
    _, fleet, dist = load_plan(_write(tmp_path, _config(tmp_path, **{"prfaas.egress_gbps": link_gbps})))
    result = plan(fleet, dist)
    assert result.best.lambda_max_rps == pytest.approx(1.2)
    assert result.best.bottleneck == "egress link"
    assert result.best.egress_gbps == pytest.approx(link_gbps)
    # Naive ships 200 MiB per request on average: 1.2 x 150 / 200 = 0.9 req/s.
    assert result.naive_heterogeneous.lambda_max_rps == pytest.approx(0.9)
    assert result.naive_heterogeneous.bottleneck == "egress link"


def test_evaluate_one_point_and_the_search_never_loses_to_a_baseline(tmp_path):
    _, fleet, dist = load_plan(_write(tmp_path, _config(tmp_path)))
    point = evaluate(fleet, dist, 1500, 1)  # 3000 offloaded, 1P2D: min(2, local 1 / (0.5 x 2), 3) = 1
    assert point.lambda_max_rps == pytest.approx(1.0)
    assert point.bottleneck == "local prefill"
    assert point.threshold_tokens == 1500
    config, fleet, dist = load_plan(CASE_STUDY)
    result = plan(fleet, dist)
    assert result.best.lambda_max_rps >= result.homogeneous_pd.lambda_max_rps
    assert result.best.lambda_max_rps >= result.naive_heterogeneous.lambda_max_rps
    for n_prefill in range(fleet.local_instances):
        for threshold in (4096, 19_400, 65_536, None):
            assert (
                evaluate(fleet, dist, threshold, n_prefill).lambda_max_rps
                <= result.best.lambda_max_rps + 1e-9
            )


# --- the command line ---


def test_cli_json_fields_on_the_case_study():
    done = _cli("--config", str(CASE_STUDY), "--json")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    for field in (
        "threshold_tokens",
        "n_prefill",
        "n_decode",
        "offload_fraction",
        "egress_gbps",
        "lambda_max_rps",
    ):
        assert field in body
    assert set(body["baselines"]) == {"homogeneous_pd", "naive_heterogeneous"}
    assert body["n_prefill"] + body["n_decode"] == 8
    assert 0 < body["offload_fraction"] < 1
    assert 0 < body["egress_gbps"] < body["egress_link_gbps"]
    assert body["lambda_max_rps"] > body["baselines"]["homogeneous_pd"]["lambda_max_rps"]
    assert body["baselines"]["homogeneous_pd"]["egress_gbps"] == 0
    assert body["baselines"]["naive_heterogeneous"]["offload_fraction"] == 1


def test_cli_table_shows_the_three_configurations(tmp_path):
    done = _cli("--config", str(_write(tmp_path, _config(tmp_path))))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    best = next(line for line in lines if line.startswith("PrfaaS (best)"))
    assert "> 1,000" in best and "2P 1D" in best and "1.50" in best and "2.25x" in best
    assert any(line.startswith("homogeneous PD") and "none offloaded" in line for line in lines)
    assert any(line.startswith("naive heterogeneous") and "all offloaded" in line for line in lines)


def test_cli_trace_replaces_the_workload(tmp_path):
    # The case-study hardware over the two-prompt trace: lengths and the mean output (100) from it.
    done = _cli("--config", str(CASE_STUDY), "--trace", _trace(tmp_path), "--json")
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["workload"].startswith("trace ") and body["workload"].endswith("(2 requests)")
    assert body["mean_input_tokens"] == 2000
    assert body["output_tokens"] == 100
    assert body["threshold_tokens"] in (None, 0, 1000)  # only three distinct cuts exist
    missing = _cli("--config", str(CASE_STUDY), "--trace", str(tmp_path / "none.jsonl"))
    assert missing.returncode == 2 and "cannot read" in missing.stderr


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"local.decode": None}, "local.decode: Field required"),
        ({"prfaas.colour": "blue"}, "prfaas.colour: Extra inputs are not permitted"),
        ({"prfaas.prefill_latency_s": {1000: 1.0}}, "prfaas.prefill_latency_s"),
        ({"prfaas.egress_gbps": 0}, "prfaas.egress_gbps"),
        ({"local.instances": 1}, "local.instances"),
        ({"workload.input_length": {"trace": "missing.jsonl"}}, "cannot read"),
        (
            {"workload.input_length": {"lognormal": {"mu": 9.9, "sigma": 1.0, "min": 128, "max": 131072}}},
            "output_tokens is required",
        ),
        ({"workload.input_length": {}}, "exactly one of lognormal or trace"),
        (
            {"workload.input_length": {"lognormal": {"mu": 9.9, "sigma": 1.0, "min": 512, "max": 128}}},
            "max must be greater than min",
        ),
    ],
)
def test_bad_configs_exit_2_with_the_key_named(tmp_path, overrides, message):
    done = _cli("--config", str(_write(tmp_path, _config(tmp_path, **overrides))))
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert done.stdout == ""


def test_unreadable_or_non_mapping_files_are_refused(tmp_path):
    (tmp_path / "broken.yaml").write_text("prfaas: [unclosed\n")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    for name, message in (
        ("broken.yaml", "invalid YAML"),
        ("list.yaml", "invalid planner config"),
        ("nope.yaml", "cannot read"),
    ):
        with pytest.raises(PlanConfigError, match=message):
            load_plan(tmp_path / name)
        done = _cli("--config", str(tmp_path / name))
        assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr
