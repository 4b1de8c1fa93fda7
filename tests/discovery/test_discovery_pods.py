"""What a pod's JSON and an InferencePool say about instances (kvgate/discovery/pods.py)."""

from __future__ import annotations

import pytest

from kvgate.config.settings import InstanceRole
from kvgate.discovery.pods import PodError, is_ready, pod_instances, pool_target


def pod(name="p", ip="10.0.0.5", labels=None, annotations=None, ready=True, phase="Running", deleting=False) -> dict:
    metadata = {"name": name, "labels": labels or {}, "annotations": annotations or {}}
    if deleting:
        metadata["deletionTimestamp"] = "2030-01-01T00:00:00Z"
    return {"metadata": metadata, "status": {"phase": phase, "podIP": ip,
                                             "conditions": [{"type": "Ready", "status": str(ready)}]}}


def test_only_running_ready_pods_with_an_ip_that_are_not_being_deleted_are_instances():
    assert is_ready(pod())
    for unready in (pod(ready=False), pod(phase="Pending"), pod(ip=""), pod(deleting=True), {"metadata": {}}):
        assert not is_ready(unready)
        assert pod_instances(unready, None, 8000, "m") == []


def test_labels_and_annotations_make_the_instance():
    [instance] = pod_instances(pod(labels={"kvgate.io/role": "prefill", "kvgate.io/port": "9000"},
                                   annotations={"kvgate.io/model": "org/model", "kvgate.io/bootstrap-port": "8998",
                                                "kvgate.io/kv-events-port": "5557",
                                                "kvgate.io/kv-events-replay-port": "5558",
                                                "kvgate.io/max-model-len": "4096", "kvgate.io/cluster": "east",
                                                "kvgate.io/role": "decode"}),  # the label wins
                               None, 8000, "default-model")
    assert instance.id == "p" and instance.url == "http://10.0.0.5:9000" and instance.model == "org/model"
    assert instance.role is InstanceRole.PREFILL and instance.bootstrap_port == 8998
    assert instance.kv_events_endpoint == "tcp://10.0.0.5:5557"
    assert instance.kv_events_replay_endpoint == "tcp://10.0.0.5:5558"
    assert instance.max_model_len == 4096 and instance.cluster == "east"


def test_defaults_ipv6_and_pool_ports():
    [plain] = pod_instances(pod(), None, 8000, "m")
    assert (plain.url, plain.model, plain.role) == ("http://10.0.0.5:8000", "m", InstanceRole.NEUTRAL)
    [v6] = pod_instances(pod(ip="fd00::7"), (8000,), 1, "m")
    assert v6.url == "http://[fd00::7]:8000"
    assert [i.id for i in pod_instances(pod(), (8000, 8001), 1, "m")] == ["p:8000", "p:8001"]


@pytest.mark.parametrize("labels, annotations, message", [
    ({}, {"kvgate.io/port": "99999"}, "kvgate.io/port"),
    ({"kvgate.io/role": "leader"}, {}, "role"),
    ({}, {"kvgate.io/max-model-len": "-3"}, "max_model_len"),
    ({}, {}, "kvgate.io/model or --discovery-model"),
])
def test_bad_keys_say_which(labels, annotations, message):
    model = "m" if labels or annotations else ""
    with pytest.raises(PodError, match=message):
        pod_instances(pod(labels=labels, annotations=annotations), None, 8000, model)


def test_pool_target():
    pool = {"metadata": {"name": "llama"},
            "spec": {"selector": {"matchLabels": {"b": "2", "a": "1"}}, "targetPorts": [{"number": 8000}]}}
    assert pool_target(pool) == ("a=1,b=2", (8000,))
    with pytest.raises(ValueError, match="llama"):
        pool_target({"metadata": {"name": "llama"}, "spec": {"selector": {"matchLabels": {"a": "1"}}}})
