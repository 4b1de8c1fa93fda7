"""PrfaaS cluster decision: incremental-length threshold, both bandwidth modes, link estimate,
threshold adaptation within bounds, and its settings."""

from __future__ import annotations

import pytest

from kvgate.config.loader import ConfigError, load_settings
from kvgate.config.settings import InstanceConfig, PrfaasBandwidthMode, Settings
from kvgate.scheduler.prfaas import MIB, KVSize, LinkMeter, PrefillQueues, PrfaasRequest, PrfaasRouter

CALM = PrefillQueues(local_tokens_per_instance=0, prfaas_tokens_per_instance=0)
KV_PER_TOKEN = 1000  # bytes, so egress figures read as tokens x 1000


def _settings(**overrides) -> Settings:
    values = {
        "prfaas_cluster": "remote",
        "prfaas_egress_gbps": 8.0,  # 1e9 bytes/s
        "prfaas_kv_bytes_per_token": KV_PER_TOKEN,
        "prfaas_threshold_tokens": 8192,
        "prfaas_threshold_min_tokens": 2048,
        "prfaas_threshold_max_tokens": 32768,
        "prfaas_link_window_s": 10.0,
        "prfaas_adapt_interval_s": 5.0,
        "prfaas_adapt_factor": 2.0,
        **overrides,
    }
    return Settings(**values)


# (mode, prompt, local hit, remote hit) -> (cluster, incremental, prefix, prefix cluster, shipped, egress tokens)
DECISIONS = [
    # A long prompt whose prefix is cached locally stays local: 20000 - 16384 = 3616 <= 8192.
    ("scarce", 20000, 16384, 0, ("local", 3616, 16384, "local", 0, 0)),
    # Scarce: judged on the local prefix alone; remote then reuses its own prefix, KV of all 20000 crosses.
    ("scarce", 20000, 0, 16384, ("remote", 3616, 16384, "remote", 0, 20000)),
    ("scarce", 20000, 4096, 16384, ("remote", 3616, 16384, "remote", 0, 20000)),
    ("scarce", 4000, 0, 0, ("local", 4000, 0, "local", 0, 0)),
    # The threshold itself stays local; one token more crosses.
    ("scarce", 8192, 0, 0, ("local", 8192, 0, "local", 0, 0)),
    ("scarce", 8193, 0, 0, ("remote", 8193, 0, "remote", 0, 8193)),
    # Abundant: the longer prefix wherever it lies. Remote prefix 16384 leaves 3616: local, prefix shipped home.
    ("abundant", 20000, 4096, 16384, ("local", 3616, 16384, "remote", 16384, 16384)),
    ("abundant", 20000, 16384, 0, ("local", 3616, 16384, "local", 0, 0)),
    # Too long even after the local prefix: remote, the local prefix shipped out (not egress).
    ("abundant", 40000, 16384, 4096, ("remote", 23616, 16384, "local", 16384, 40000)),
    ("abundant", 40000, 0, 20000, ("remote", 20000, 20000, "remote", 0, 40000)),
    # Equal prefixes: nothing to ship, the local one counts.
    ("abundant", 20000, 12000, 12000, ("local", 8000, 12000, "local", 0, 0)),
    # Hits longer than the prompt (a stale index) are clipped to it.
    ("scarce", 3000, 9000, 0, ("local", 0, 3000, "local", 0, 0)),
]


@pytest.mark.parametrize(("mode", "prompt", "local_hit", "remote_hit", "expected"), DECISIONS)
def test_cluster_decision(mode, prompt, local_hit, remote_hit, expected):
    router = PrfaasRouter(_settings(prfaas_bandwidth_mode=mode))
    decision = router.decide(PrfaasRequest(prompt, local_hit, remote_hit), 0.0, CALM)
    cluster, incremental, prefix, prefix_cluster, shipped, egress_tokens = expected
    got = (
        decision.cluster,
        decision.incremental_tokens,
        decision.prefix_tokens,
        decision.prefix_cluster,
        decision.shipped_prefix_tokens,
        decision.egress_bytes // KV_PER_TOKEN,
    )
    assert got == expected
    assert decision.offloaded == (cluster == "remote")
    assert decision.mode == PrfaasBandwidthMode(mode)
    assert decision.threshold_tokens == 8192
    assert (">" if decision.offloaded else "<=") + " threshold 8192" in decision.reason
    assert mode in decision.reason


def test_no_prfaas_instance_keeps_everything_local_with_the_local_prefix():
    router = PrfaasRouter(_settings(prfaas_bandwidth_mode="abundant"))
    decision = router.decide(PrfaasRequest(40000, 1024, 30000), 0.0, CALM, prfaas_available=False)
    assert (decision.cluster, decision.prefix_tokens, decision.prefix_cluster, decision.egress_bytes) == (
        "local",
        1024,
        "local",
        0,
    )
    assert "no PrfaaS instance up" in decision.reason


def test_no_local_prefill_instance_sends_everything_remote_with_the_remote_prefix():
    router = PrfaasRouter(_settings(prfaas_bandwidth_mode="scarce"))
    decision = router.decide(PrfaasRequest(1000, 512, 768), 0.0, CALM, local_available=False)
    assert (decision.cluster, decision.prefix_tokens, decision.egress_bytes) == ("remote", 768, 1000 * KV_PER_TOKEN)
    assert "no local prefill instance up" in decision.reason


def test_the_naive_rule_judges_total_length_whatever_is_cached():
    naive = PrfaasRouter(_settings(prfaas_bandwidth_mode="scarce"), judge_cached_prefix=False)
    rule = PrfaasRouter(_settings(prfaas_bandwidth_mode="scarce"))
    request = PrfaasRequest(40000, 39000, 0)  # long, but almost all cached locally
    assert rule.decide(request, 0.0, CALM).cluster == "local"
    decision = naive.decide(request, 0.0, CALM)
    assert decision.cluster == "remote" and decision.incremental_tokens == 40000


def test_a_dry_run_neither_adapts_nor_counts():
    router = PrfaasRouter(_settings(prfaas_adapt_interval_s=0.001))
    router.record_egress(0.0, 10**10)  # far beyond the link's capacity over the window
    for now in (1.0, 2.0):
        router.decide(PrfaasRequest(40000, 0, 0), now, CALM, dry_run=True)
    assert router.controller.threshold == 8192 and router.offload_fraction(2.0) == 0.0
    router.decide(PrfaasRequest(40000, 0, 0), 3.0, CALM)
    assert router.controller.threshold == 16384 and router.offload_fraction(3.0) == 1.0


def test_cluster_view_groups_hits_and_queues_by_cluster():
    from kvgate.config.settings import InstanceRole
    from kvgate.scheduler.prfaas import cluster_view
    from kvgate.scheduler.types import Candidate, InstanceLoad

    def candidate(id_: str, queued: int) -> Candidate:
        return Candidate(id_, InstanceRole.PREFILL, InstanceLoad(all_prefills_tokens_num=queued))

    view = cluster_view(5000, [candidate("p0", 100), candidate("p1", 300), candidate("r0", 900)],
                        {"p0": 512, "d0": 2048, "r0": 1024}, {"p0": "local", "p1": "local", "r0": "remote",
                                                              "d0": "local"}, "remote")
    assert [c.id for c in view.local] == ["p0", "p1"] and [c.id for c in view.prfaas] == ["r0"]
    # Any local instance's prefix counts (the store serves it within the cluster), decode ones too.
    assert view.request == PrfaasRequest(5000, 2048, 1024)
    assert view.queues == PrefillQueues(200.0, 900.0)


def test_auto_mode_turns_scarce_when_the_link_fills():
    router = PrfaasRouter(_settings())  # auto, abundant below 50%
    request = PrfaasRequest(20000, 4096, 16384)
    first = router.decide(request, 0.0, CALM)
    assert (first.mode, first.cluster, first.shipped_prefix_tokens) == ("abundant", "local", 16384)
    router.record_egress(0.0, 5 * 10**9)  # 5 GB over a 10 s window on a 1 GB/s link: 50%
    second = router.decide(request, 1.0, CALM)
    assert second.link_utilisation == pytest.approx(0.5)
    assert (second.mode, second.cluster, second.prefix_cluster) == ("scarce", "remote", "remote")


def test_link_meter_is_a_sliding_window():
    meter = LinkMeter(capacity_bytes_per_s=1e9, window_s=10.0)
    meter.record(0.0, 4 * 10**9)
    meter.record(6.0, 2 * 10**9)
    assert meter.bytes_per_s(6.0) == pytest.approx(6e8)
    assert meter.utilisation(9.99) == pytest.approx(0.6)
    assert meter.utilisation(10.0) == pytest.approx(0.2)  # the first record left the window
    assert meter.utilisation(16.0) == 0.0


# (link utilisation, local queue, remote queue) per adaptation step, 6 s apart -> threshold after it.
ADAPTATION = [
    (
        "saturated link raises it to the bound",
        [((0.95, 0, 0), 16384), ((0.95, 0, 0), 32768), ((0.95, 0, 0), 32768)],
    ),
    ("saturated PrfaaS queue raises it", [((0.1, 0, 70000), 16384)]),
    (
        "saturated local queue lowers it to the bound",
        [((0.1, 70000, 0), 4096), ((0.1, 70000, 0), 2048), ((0.1, 70000, 0), 2048)],
    ),
    ("the link wins over the local queue", [((0.95, 70000, 0), 16384)]),
    (
        "calm drifts back",
        [((0.95, 0, 0), 16384), ((0.95, 0, 0), 32768), ((0.1, 0, 0), 16384), ((0.1, 0, 0), 8192)],
    ),
    ("calm from below drifts back", [((0.1, 70000, 0), 4096), ((0.1, 0, 0), 8192), ((0.1, 0, 0), 8192)]),
]


@pytest.mark.parametrize(("name", "steps"), ADAPTATION, ids=[case[0] for case in ADAPTATION])
def test_threshold_adaptation_stays_within_bounds(name, steps):
    router = PrfaasRouter(_settings(prfaas_queue_saturated_tokens=65536))
    controller = router.controller
    for i, ((utilisation, local_q, remote_q), expected) in enumerate(steps):
        controller.adapt(i * 6.0, utilisation, PrefillQueues(local_q, remote_q))
        assert controller.threshold == expected, (name, i)
        assert 2048 <= controller.threshold <= 32768


def test_adaptation_waits_for_its_interval():
    router = PrfaasRouter(_settings())
    router.controller.adapt(0.0, 0.95, CALM)
    router.controller.adapt(4.9, 0.95, CALM)
    assert router.controller.threshold == 16384
    router.controller.adapt(5.0, 0.95, CALM)
    assert router.controller.threshold == 32768
    assert router.controller.last_change == "link 95% >= 90%: 16384 -> 32768"


def test_a_saturated_link_keeps_prompts_it_used_to_send_local():
    router = PrfaasRouter(_settings(prfaas_bandwidth_mode="scarce"))
    request = PrfaasRequest(12000, 0, 0)
    assert router.decide(request, 0.0, CALM).cluster == "remote"
    router.record_egress(0.0, 10 * 10**9)  # a full window: 100% of the link
    decision = router.decide(request, 6.0, CALM)
    assert decision.threshold_tokens == 16384
    assert decision.cluster == "local"
    assert "incremental 12000" in decision.reason and "<= threshold 16384" in decision.reason


def test_offload_fraction_over_the_window():
    router = PrfaasRouter(_settings(prfaas_bandwidth_mode="scarce"))
    for now, prompt in ((0.0, 20000), (1.0, 20000), (2.0, 100)):
        router.decide(PrfaasRequest(prompt, 0, 0), now, CALM)
    assert router.offload_fraction(2.0) == pytest.approx(2 / 3)
    assert router.offload_fraction(11.5) == pytest.approx(0.0)  # only the local one is left
    assert router.offload_fraction(30.0) == 0.0


def test_kv_size_from_a_table_or_per_token():
    table = KVSize({1024: 1.0, 2048: 2.0}, 0)
    assert table.bytes(1536) == int(1.5 * MIB)
    assert table.bytes(4096) == int(4.0 * MIB)  # last segment extended
    assert table.bytes(0) == 0
    assert KVSize({}, 2.5).bytes(1000) == 2500


def test_prfaas_settings_and_instance_cluster():
    assert InstanceConfig(id="a", url="http://127.0.0.1:1", model="m").cluster == "local"
    settings = load_settings(
        {
            "prfaas_cluster": "h200",
            "prfaas_egress_gbps": "100",
            "prfaas_kv_size_mib": "1024:190.8, 8192:308.9",
            "prfaas_threshold_tokens": "19400",
        },
        environ={},
    )
    assert settings.prfaas_kv_size_mib == {1024: 190.8, 8192: 308.9}
    assert PrfaasRouter(settings).kv_size.bytes(1024) == int(190.8 * MIB)
    assert load_settings({}, environ={}).prfaas_cluster == ""


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"prfaas_cluster": "local", "prfaas_egress_gbps": "1", "prfaas_kv_bytes_per_token": "1"},
            "cannot be 'local'",
        ),
        ({"prfaas_cluster": "r", "prfaas_kv_bytes_per_token": "1"}, "prfaas_egress_gbps must be > 0"),
        (
            {"prfaas_cluster": "r", "prfaas_egress_gbps": "1"},
            "needs prfaas_kv_size_mib or prfaas_kv_bytes_per_token",
        ),
        (
            {"prfaas_cluster": "r", "prfaas_egress_gbps": "1", "prfaas_kv_size_mib": "1024:1"},
            "two lengths or more",
        ),
        ({"prfaas_kv_size_mib": "1024=1"}, "LENGTH:MIB pairs"),
        (
            {
                "prfaas_cluster": "r",
                "prfaas_egress_gbps": "1",
                "prfaas_kv_bytes_per_token": "1",
                "prfaas_threshold_tokens": "1000",
            },
            "min <= threshold <= max",
        ),
        ({"prfaas_bandwidth_mode": "plenty"}, "prfaas-bandwidth-mode"),
    ],
)
def test_bad_prfaas_settings_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        load_settings(values, environ={})


def test_prfaas_settings_from_a_yaml_file(tmp_path):
    path = tmp_path / "kvgate.yaml"
    path.write_text(
        "prfaas_cluster: h200\n"
        "prfaas_egress_gbps: 100\n"
        "prfaas_kv_size_mib: {1024: 190.8, 8192: 308.9, 32768: 701.3}\n"
        "instances:\n"
        "  - {id: p0, url: 'http://127.0.0.1:9001', model: m, role: prefill, cluster: h200}\n"
        "  - {id: d0, url: 'http://127.0.0.1:9002', model: m, role: decode}\n"
    )
    settings = load_settings({}, config_path=str(path), environ={})
    assert [inst.cluster for inst in settings.instances] == ["h200", "local"]
    assert PrfaasRouter(settings).kv_size.bytes(32768) == int(701.3 * MIB)


def test_only_models_with_a_prfaas_cluster_take_the_cluster_rule():
    from kvgate.config.settings import InstanceRole
    from kvgate.scheduler.router import Scheduler
    from kvgate.scheduler.types import Candidate, InstanceLoad

    def inst(id_: str, model: str, role: str, cluster: str = "local") -> InstanceConfig:
        return InstanceConfig(id=id_, url=f"http://127.0.0.1:{8000 + len(id_)}", model=model, role=role,
                              cluster=cluster)

    instances = [inst("p", "a", "prefill"), inst("d", "a", "decode"), inst("r", "a", "prefill", "remote"),
                 inst("p2", "b", "prefill"), inst("d2", "b", "decode")]
    scheduler = Scheduler(_settings(pd_protocol="vllm", instances=instances), instances)

    def decide(prefill: list[str], decode: str):
        candidates = [Candidate(i, InstanceRole.PREFILL, InstanceLoad()) for i in prefill]
        return scheduler.decide_pd(40000, [], None, candidates, [Candidate(decode, InstanceRole.DECODE,
                                                                           InstanceLoad())], {}, now=0.0)

    served_a = decide(["p", "r"], "d")
    assert served_a.cluster is not None and served_a.cluster.cluster == "remote"
    assert served_a.prefill.ranking == ("r",)
    served_b = decide(["p2"], "d2")  # model b has no PrfaaS instance: plain PD, no cluster decision
    assert served_b.cluster is None and served_b.prefill.ranking == ("p2",)
    assert scheduler.prfaas is not None and scheduler.prfaas.offload_fraction(0.0) == 1.0  # b was not counted
