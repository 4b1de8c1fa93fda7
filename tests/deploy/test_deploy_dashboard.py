"""deploy/grafana/kvgate.json reads only what kvgate exports: real gateways in front of mock engines
are driven until every series exists, and every metric name (and `by` label) of every query must
be among the samples their /metrics shows. PromQL syntax is checked by Prometheus's promtool."""

from __future__ import annotations

import json
import shutil
import subprocess

import aiohttp
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.dashboard import (
    DASHBOARD_PATH,
    dashboard_fleet,
    exercise,
    grouping_labels,
    load_panels,
    metric_names,
)
from tests.gateway_helpers import tokenizer

PANELS = load_panels()
DASHBOARD = json.loads(DASHBOARD_PATH.read_text())


async def _samples(url: str) -> dict[str, set[str]]:
    """Sample name (with its _total/_bucket/... suffix) -> the label names its samples carry."""
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as answer:
        assert answer.status == 200
        text = await answer.text()
    found: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            found.setdefault(sample.name, set()).update(sample.labels)
    return found


def test_the_dashboard_covers_what_operators_watch():
    names = {name for panel in PANELS for target in panel.targets for name in metric_names(target.expr)}
    for required in ("kvgate_predicted_cached_tokens_total", "kvgate_reported_cached_tokens_total",
                     "kvgate_hit_comparisons_total", "kvgate_ttft_seconds_bucket",
                     "kvgate_ttft_prediction_error_seconds_bucket", "kvgate_stage_seconds_bucket",
                     "kvgate_inflight_requests", "kvgate_instance_healthy", "kvgate_kvs_queries_total",
                     "kvgate_kv_events_lag_seconds_bucket", "kvgate_kv_events_resets_total",
                     "kvgate_admission_rejections_total", "kvgate_prfaas_decisions_total",
                     "kvgate_prfaas_link_utilisation"):
        assert required in names
    for panel in PANELS:
        assert panel.targets, panel.title
        for target in panel.targets:
            assert metric_names(target.expr), f"{panel.title}: {target.expr} reads no kvgate metric"
    ids = [p["id"] for p in DASHBOARD["panels"]]
    assert len(ids) == len(set(ids))
    datasources = {t["datasource"]["uid"] for p in DASHBOARD["panels"] for t in p.get("targets", [])}
    assert datasources == {"${datasource}"}
    assert [v["name"] for v in DASHBOARD["templating"]["list"]] == ["datasource"]


def test_every_query_parses_as_promql(tmp_path):
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not on PATH (Debian package prometheus)")
    rules = [{"record": f"kvgate:dashboard_{n}", "expr": target.expr.replace("$__rate_interval", "1m")}
             for n, target in enumerate(t for panel in PANELS for t in panel.targets)]
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert f"{len(rules)} rules found" in checked.stdout


def test_the_metric_name_reader_handles_suffixes_and_strings():
    expr = ('histogram_quantile(0.9, sum by (le, stage) (rate(kvgate_stage_seconds_bucket[5m]))) '
            '+ sum(kvgate_x_total{route="kvgate_not_a_read"})')
    assert metric_names(expr) == {"kvgate_stage_seconds_bucket", "kvgate_x_total"}
    assert grouping_labels(expr) == {"stage"}


async def _exported(gateways) -> dict[str, set[str]]:
    exported: dict[str, set[str]] = {}
    for gateway in gateways:
        for name, labels in (await _samples(gateway.url)).items():
            exported.setdefault(name, set()).update(labels)
    return exported


async def test_every_metric_the_dashboard_reads_is_exported(tmp_path, redis_url):
    read = {name for panel in PANELS for target in panel.targets for name in metric_names(target.expr)}
    async with dashboard_fleet(tmp_path, redis_url, tokenizer=tokenizer()) as fleet:
        # Rounds until every series is there (the health checks eject the dead instance, the events
        # subscriber applies and resets, ...), bounded.
        for round_number in range(30):
            await exercise(fleet, round_number)
            exported = await _exported(fleet.gateways)
            if read <= exported.keys():
                break
    missing = []
    for panel in PANELS:
        for target in panel.targets:
            names = metric_names(target.expr)
            for name in names:
                if name not in exported:
                    missing.append(f"{panel.title}: {name}")
                elif len(names) == 1 and not grouping_labels(target.expr) <= exported[name]:
                    missing.append(f"{panel.title}: {name} has no label in {grouping_labels(target.expr)}")
    assert not missing, "the dashboard reads series kvgate does not export:\n" + "\n".join(missing)
