"""Adding and removing instances at run time: the one code path the admin routes and discovery share.

An instance added at run time passes the rules an instance can break on its own (URL inside
--instance-networks, a role the PD protocol can serve, bootstrap fields only on prefill instances,
LoRA adapters consistent with the fleet's);
a fleet is completed one add at a time, so a prefill instance may come before its decode instances.
A removed instance takes no new request; requests already sent to it finish normally and their
account entries still release.
"""

from __future__ import annotations

from kvgate.config.instance_rules import check_lora_adapters, check_url_in_networks, parse_networks
from kvgate.config.pd import check_bootstrap_fields, check_pd_serving
from kvgate.config.settings import InstanceConfig
from kvgate.gateway.fleet.registry import InstanceState
from kvgate.gateway.state import Gateway


class InstanceRefused(ValueError):
    """An instance that breaks a rule of the fleet; `param` names the offending field."""

    def __init__(self, message: str, param: str, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def add_instance(gateway: Gateway, config: InstanceConfig, discovered: bool = False) -> InstanceState:
    """Check `config` and add it to the registry (`discovered`: by fleet discovery). Raises
    InstanceRefused, or the registry's RegistryError (id taken) / RegistryFull (no room in the
    workers' shared table)."""
    try:
        check_url_in_networks(config.url, parse_networks(gateway.settings.instance_networks))
    except ValueError as exc:
        raise InstanceRefused(f"invalid instance 'url': {exc}", "url", "instance_network_refused") from None
    try:
        check_pd_serving([config], gateway.settings.pd_protocol)
        check_bootstrap_fields(config)
    except ValueError as exc:
        raise InstanceRefused(f"invalid instance 'role': {exc}", "role") from None
    try:
        check_lora_adapters([*gateway.registry.configs(), config])
    except ValueError as exc:
        raise InstanceRefused(f"invalid instance 'lora_adapters': {exc}", "lora_adapters") from None
    state = gateway.registry.add(config, discovered)
    gateway.metrics.instance_healthy.labels(state.id).set(1)
    return state


def remove_instance(gateway: Gateway, instance_id: str) -> InstanceState:
    """Take `instance_id` out of the registry; RegistryError if there is none."""
    state = gateway.registry.remove(instance_id)
    gateway.metrics.instance_healthy.remove(state.id)
    return state


class GatewayFleet:
    """The running gateway's registry as discovery sees it (kvgate/discovery/reconciler.py's FleetControl)."""

    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    def ids(self) -> set[str]:
        return {state.id for state in self._gateway.registry.states()}

    def discovered(self) -> dict[str, InstanceConfig]:
        return {state.id: state.config for state in self._gateway.registry.states() if state.discovered}

    def add(self, config: InstanceConfig) -> None:
        add_instance(self._gateway, config, discovered=True)

    def remove(self, instance_id: str) -> None:
        remove_instance(self._gateway, instance_id)
