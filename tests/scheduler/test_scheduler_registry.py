"""Policies and metrics behind one registry; config/ is a leaf."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvgate.config
from kvgate.config import ConfigError, Settings, load_settings
from kvgate.scheduler.registry import METRICS, POLICIES, build_metrics, check_settings, make_policy
from kvgate.scheduler.types import Candidate, InstanceLoad, RoutingRequest


def test_config_imports_nothing_of_the_project_outside_config():
    for path in Path(kvgate.config.__file__).parent.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvgate"):
                assert node.module.startswith("kvgate.config"), f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("kvgate") and not a.name.startswith("kvgate.config")
                               for a in node.names), path.name


@pytest.mark.parametrize("name", list(POLICIES))
def test_every_registered_policy_builds_and_ranks(name):
    policy = make_policy(Settings(dispatch_policy=name))
    assert policy.name == name
    loads = [Candidate(i, "neutral", InstanceLoad(n, 0, 10 * n, 0.0)) for n, i in enumerate(("a", "b"))]
    decision = policy.select(RoutingRequest(10), loads)
    assert set(decision.ranking) == {"a", "b"}


def test_every_registered_metric_builds_with_its_name():
    metrics = build_metrics(Settings())
    assert list(metrics) == list(METRICS)
    assert all(metric.name == name for name, metric in metrics.items())


@pytest.mark.parametrize(
    ("values", "flag"),
    [
        ({"dispatch_policy": "fastest"}, "--dispatch-policy"),
        ({"dispatch_metric_order": "num_requests,speed"}, "--dispatch-metric-order"),
        ({"dispatch_policy": "conductor", "kvcache_balancing_threshold": "0.5"}, "--kvcache-balancing-threshold"),
        ({"early_rejection": "sometimes"}, "--early-rejection"),
        ({"ttft_prefill_points": "1000:1,500:2"}, "--ttft-prefill-points"),
    ],
)
def test_start_up_errors_name_the_flag(values, flag):
    with pytest.raises(ConfigError, match=flag):
        check_settings(load_settings(values, environ={}))


def test_flags_parse_and_the_deprecated_rate_becomes_a_linear_curve():
    settings = load_settings({"ttft_prefill_points": "1024:0.05, 4096:0.3", "decode_step_s": "0.01,1e-4,0"},
                             environ={})
    assert settings.ttft_prefill_points == ((1024, 0.05), (4096, 0.3))
    assert settings.decode_step_s == (0.01, 1e-4, 0.0)
    legacy = load_settings({"prefill_tokens_per_s": "2000", "ttft_slo_s": "1"}, environ={})
    assert legacy.ttft_prefill_points == ((1, 0.0005), (1_000_000, 500.0))
    assert legacy.early_rejection == "early"  # --ttft-slo-s alone keeps rejecting, as before
    assert load_settings({"ttft_slo_s": "1", "early_rejection": "none"}, environ={}).early_rejection == "none"
