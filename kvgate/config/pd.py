"""Which prefill/decode fleets make sense: checked once when the settings are built.

A model served by prefill instances needs decode instances and the other way round, a gateway
serving them needs a hand-off protocol, and bootstrap fields belong to prefill instances only. A mistake here would
otherwise show up as every request of a model failing, so start-up refuses it with the reason.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Protocol


class PDInstance(Protocol):
    """The fields of settings.InstanceConfig these rules read (settings.py calls them: no import back)."""

    id: str
    model: str
    role: str
    bootstrap_port: int | None
    bootstrap_host: str


PDProtocol = str  # settings.PDProtocol, a StrEnum: "sglang" | "vllm"

# SGLang's --disaggregation-bootstrap-port default, used when a prefill instance names none.
SGLANG_DEFAULT_BOOTSTRAP_PORT = 8998


def check_pd_serving(instances: Sequence[PDInstance], protocol: PDProtocol | None) -> None:
    """A gateway serving prefill or decode instances must know their hand-off. (Checked when
    serving only: planners read fleets with these roles without speaking to them.)"""
    disaggregated = sorted(i.id for i in instances if i.role in ("prefill", "decode"))
    if disaggregated and protocol is None:
        raise ValueError(
            f"instances {disaggregated} have role prefill or decode but pd_protocol is not set "
            "(--pd-protocol sglang | vllm)"
        )


def check_bootstrap_fields(instance: PDInstance) -> None:
    if instance.role != "prefill" and (instance.bootstrap_port is not None or instance.bootstrap_host):
        raise ValueError(
            f"instance {instance.id!r}: bootstrap_port and bootstrap_host apply to prefill instances only"
        )


def check_pd_fleet(
    instances: Sequence[PDInstance], protocol: PDProtocol | None, skip_below_tokens: int
) -> None:
    """Raise ValueError naming the first invalid combination."""
    roles: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for instance in instances:
        roles[instance.model][instance.role].append(instance.id)
        check_bootstrap_fields(instance)
    for model, by_role in sorted(roles.items()):
        if by_role.get("decode") and not by_role.get("prefill"):
            raise ValueError(f"model {model!r}: decode instances {by_role['decode']} but no prefill instance")
        if by_role.get("prefill") and not by_role.get("decode"):
            raise ValueError(f"model {model!r}: prefill instances {by_role['prefill']} but no decode instance")
    if skip_below_tokens and protocol == "sglang":
        raise ValueError(
            "pd_skip_prefill_below_tokens needs pd_protocol vllm: an SGLang decode server only serves "
            "requests whose KV arrives through a bootstrap room"
        )
