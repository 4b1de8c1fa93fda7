"""What a pod says about the engine instance(s) it runs: pure functions over the pod's JSON.

A pod is an instance while it runs, has an IP, its Ready condition is True and it is not being
deleted. Its keys below are read from its labels first, then its annotations (model names such as
`meta-llama/Llama-3.1-8B` are not valid label values, so they go in an annotation):

| key                           | InstanceConfig field        | default                          |
| kvgate.io/model               | model                       | --discovery-model                |
| kvgate.io/role                | role                        | neutral                          |
| kvgate.io/port                | the URL's port              | --discovery-port (no pool)       |
| kvgate.io/bootstrap-port      | bootstrap_port              | none                             |
| kvgate.io/kv-events-port      | kv_events_endpoint          | none (tcp://POD_IP:PORT)         |
| kvgate.io/kv-events-replay-port | kv_events_replay_endpoint | none (tcp://POD_IP:PORT)         |
| kvgate.io/max-model-len       | max_model_len               | learnt from the engine           |
| kvgate.io/cluster             | cluster                     | local                            |

With an InferencePool every target port is an instance of its own (`POD:PORT` ids when the pool has
several ports, the pod's name when it has one), as the Gateway API inference extension defines.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from pydantic import ValidationError

from kvgate.config.settings import InstanceConfig

PREFIX = "kvgate.io/"
MODEL = PREFIX + "model"
ROLE = PREFIX + "role"
PORT = PREFIX + "port"
BOOTSTRAP_PORT = PREFIX + "bootstrap-port"
KV_EVENTS_PORT = PREFIX + "kv-events-port"
KV_EVENTS_REPLAY_PORT = PREFIX + "kv-events-replay-port"
MAX_MODEL_LEN = PREFIX + "max-model-len"
CLUSTER = PREFIX + "cluster"

Pod = dict[str, Any]


class PodError(ValueError):
    """A ready pod whose labels or annotations do not make a valid instance."""


def pod_name(pod: Pod) -> str:
    return str(pod.get("metadata", {}).get("name", ""))


def is_ready(pod: Pod) -> bool:
    metadata, status = pod.get("metadata") or {}, pod.get("status") or {}
    if metadata.get("deletionTimestamp") or status.get("phase") != "Running" or not status.get("podIP"):
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or ())


def pod_instances(pod: Pod, ports: tuple[int, ...] | None, default_port: int,
                  default_model: str) -> list[InstanceConfig]:
    """The instances a pod stands for: none while it is not ready. `ports` are an InferencePool's
    target ports (None: one instance at kvgate.io/port, else `default_port`). PodError if a ready
    pod's keys are invalid."""
    if not is_ready(pod):
        return []
    name = pod_name(pod)
    keys = {**(pod["metadata"].get("annotations") or {}), **(pod["metadata"].get("labels") or {})}
    host = pod["status"]["podIP"]
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise PodError(f"pod {name}: podIP {host!r} is not an IP address") from None
    url_host = f"[{host}]" if address.version == 6 else host
    if ports is None:
        ports = (_port(keys, PORT, name) or default_port,)
    fields: dict[str, Any] = {"model": keys.get(MODEL, default_model), "role": keys.get(ROLE, "neutral")}
    if BOOTSTRAP_PORT in keys:
        fields["bootstrap_port"] = _port(keys, BOOTSTRAP_PORT, name)
    if KV_EVENTS_PORT in keys:
        fields["kv_events_endpoint"] = f"tcp://{url_host}:{_port(keys, KV_EVENTS_PORT, name)}"
    if KV_EVENTS_REPLAY_PORT in keys:
        fields["kv_events_replay_endpoint"] = f"tcp://{url_host}:{_port(keys, KV_EVENTS_REPLAY_PORT, name)}"
    if MAX_MODEL_LEN in keys:
        fields["max_model_len"] = keys[MAX_MODEL_LEN]
    if CLUSTER in keys:
        fields["cluster"] = keys[CLUSTER]
    instances = []
    for port in ports:
        instance_id = name if len(ports) == 1 else f"{name}:{port}"
        try:
            instances.append(InstanceConfig(id=instance_id, url=f"http://{url_host}:{port}", **fields))
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise PodError(f"pod {name}: invalid instance '{where}': {first['msg']}"
                           + (f" (set {MODEL} or --discovery-model)" if where == "model" else "")) from None
    return instances


def _port(keys: dict[str, str], key: str, name: str) -> int | None:
    value = keys.get(key)
    if value is None:
        return None
    if not value.isdigit() or not 1 <= int(value) <= 65535:
        raise PodError(f"pod {name}: {key}={value!r} is not a port number (1-65535)")
    return int(value)


def pool_target(pool: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    """An InferencePool's (label selector, target ports); ValueError if it names neither."""
    spec = pool.get("spec") or {}
    match_labels = (spec.get("selector") or {}).get("matchLabels") or {}
    ports = tuple(int(p["number"]) for p in spec.get("targetPorts") or () if isinstance(p, dict) and "number" in p)
    name = (pool.get("metadata") or {}).get("name", "")
    if not match_labels or not ports:
        raise ValueError(f"InferencePool {name!r} has no spec.selector.matchLabels or no spec.targetPorts")
    return ",".join(f"{key}={value}" for key, value in sorted(match_labels.items())), ports
