"""`kvgate demo --prfaas`: the same workload through a local PD fleet, then through that fleet plus a
remote Prefill-as-a-Service cluster whose link is modelled (docs/PRFAAS.md).

The remote prefill engines hand their KV over an egress link of `--prfaas-egress-gbps` shared
equally among them, on which transfers queue (mock_engine/pd.py), at the KV size per token the
gateway prices them with; the gateway routes by the cluster rule and reports what crossed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kvgate.bench.workload import ReplayRequest
from kvgate.demo.fleet import FleetSpec, PrfaasSpec
from kvgate.demo.runner import PolicyRun, run_policy

PRFAAS_CLUSTER = "prfaas"
POLICY = "cache_aware"


@dataclass(frozen=True)
class PrfaasDemo:
    num_engines: int  # remote prefill engines
    egress_gbps: float
    kv_bytes_per_token: float
    threshold_tokens: int
    bandwidth_mode: str = "scarce"

    def spec(self, local: FleetSpec) -> FleetSpec:
        link_tokens_per_s = self.egress_gbps * 1e9 / 8 / self.kv_bytes_per_token
        gateway = {
            "prfaas_cluster": PRFAAS_CLUSTER,
            "prfaas_egress_gbps": self.egress_gbps,
            "prfaas_kv_bytes_per_token": self.kv_bytes_per_token,
            "prfaas_threshold_tokens": self.threshold_tokens,
            "prfaas_threshold_min_tokens": min(self.threshold_tokens, 2048),
            "prfaas_bandwidth_mode": self.bandwidth_mode,
            # The demo lasts seconds: the estimate and the adaptation follow it at that pace.
            "prfaas_link_window_s": 2.0,
            "prfaas_adapt_interval_s": 1.0,
        }
        return FleetSpec(local.num_engines, local.engine, local.mooncake, local.pd_protocol,
                         PrfaasSpec(self.num_engines, link_tokens_per_s, gateway))


async def read_link(gateway_url: str) -> dict[str, str]:
    """What the gateway's Prometheus says of the PrfaaS link after the replay."""
    async with aiohttp.ClientSession() as session, session.get(gateway_url + "/metrics") as answer:
        text = await answer.text()
    samples = {(s.name, s.labels.get("cluster", "")): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}
    local = samples.get(("kvgate_prfaas_decisions_total", "local"), 0.0)
    remote = samples.get(("kvgate_prfaas_decisions_total", PRFAAS_CLUSTER), 0.0)
    return {
        "prefilled in the PrfaaS cluster": f"{remote:.0f} / {local + remote:.0f}",
        "KV sent over the link": f"{samples.get(('kvgate_prfaas_egress_bytes_total', ''), 0.0) / 2**20:,.1f} MiB",
        "threshold at the end (tokens)": f"{samples.get(('kvgate_prfaas_threshold_tokens', ''), 0.0):.0f}",
    }


async def run_prfaas_demo(local: FleetSpec, demo: PrfaasDemo, requests: Sequence[ReplayRequest], tokenizer: Any,
                          progress: bool = True) -> list[PolicyRun]:
    engines = local.num_engines
    prefill = max(1, engines // 2)
    return [
        await run_policy(local, POLICY, requests, tokenizer, progress,
                         label=f"local PD {prefill}P+{engines - prefill}D"),
        await run_policy(demo.spec(local), POLICY, requests, tokenizer, progress,
                         label=f"PrfaaS +{demo.num_engines} remote", read_gateway=read_link),
    ]
