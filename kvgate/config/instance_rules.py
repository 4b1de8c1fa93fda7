"""The one rule for what an instance id and an instance URL may be, applied to instances from the
config file and from the admin routes alike (both build an `InstanceConfig`).

Why these rules: an id travels in admin paths (`/admin/instances/{id}/drain`), metric labels and
logs, so it is limited to characters that need no escaping anywhere; an id with `{`, `/` or 8 KB
of text could be added but never named again. A URL must be dialable as it stands (scheme, host,
port 1-65535, no whitespace), otherwise a request routed there fails inside the gateway instead
of being retried elsewhere.

The optional allow-list (`--instance-networks`) holds CIDRs; with it, an instance's host must be
an IP literal inside one of them. Host names are refused rather than resolved: a name checked
once can resolve elsewhere when the gateway later connects (DNS rebinding), so resolving would
only look safe.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit

MAX_INSTANCE_ID_CHARS = 128
INSTANCE_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]*")
MAX_INSTANCE_URL_CHARS = 2048

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network


def check_instance_id(value: str) -> str:
    if len(value) > MAX_INSTANCE_ID_CHARS:
        raise ValueError(f"an instance id is at most {MAX_INSTANCE_ID_CHARS} characters (got {len(value)})")
    if not INSTANCE_ID_PATTERN.fullmatch(value):
        raise ValueError("an instance id starts with a letter or digit and holds only letters, digits "
                         "and . _ : -")
    return value


def check_instance_url(value: str) -> str:
    """The URL unchanged if an engine can be dialled at it; ValueError saying what is wrong otherwise."""
    if len(value) > MAX_INSTANCE_URL_CHARS:
        raise ValueError(f"an instance URL is at most {MAX_INSTANCE_URL_CHARS} characters")
    if any(ch.isspace() or ord(ch) < 32 or ord(ch) == 127 for ch in value):
        raise ValueError("an instance URL may not contain spaces or control characters")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https"):
        raise ValueError("an instance URL starts with http:// or https://")
    if not parts.hostname:
        raise ValueError("an instance URL needs a host")
    try:
        port = parts.port
    except ValueError:
        raise ValueError("an instance URL's port must be a number from 1 to 65535") from None
    if port == 0 or (port is None and parts.netloc.endswith(":")):
        raise ValueError("an instance URL's port must be a number from 1 to 65535")
    if parts.query or parts.fragment:
        raise ValueError("an instance URL has no query or fragment (requests go to <url>/v1/...)")
    return value


def redact_url(url: str) -> str:
    """The URL with any user:password replaced by `***`, for listings and logs."""
    parts = urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rpartition("@")[2]))


_CREDENTIALS_IN_TEXT = re.compile(r"(?<=//)[^/@\s'\"]+@")


def redact_urls_in(text: str) -> str:
    """`text` with the user:password of every URL in it replaced by `***` (for error messages)."""
    return _CREDENTIALS_IN_TEXT.sub("***@", text)


def parse_networks(values: Iterable[str]) -> tuple[IPNetwork, ...]:
    networks = []
    for value in values:
        try:
            networks.append(ipaddress.ip_network(value.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{value!r} is not a network in CIDR notation (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


def check_url_in_networks(url: str, networks: tuple[IPNetwork, ...]) -> None:
    """Nothing if there is no allow-list or the URL's host is an IP inside it; ValueError otherwise."""
    if not networks:
        return
    host = urlsplit(url).hostname or ""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"host {host!r} is a name: with --instance-networks set, instance URLs must "
                         "give an IP address (names are not resolved)") from None
    if not any(address in network for network in networks):
        allowed = ", ".join(str(n) for n in networks)
        raise ValueError(f"{redact_url(url)} is outside the networks allowed for instances (--instance-networks {allowed})")


def check_lora_adapters(instances: Iterable) -> None:
    """One path per adapter name across the fleet, and no adapter named as a base model: a request
    names an adapter as its model, and its block keys mix in that one path (an `InstanceConfig`
    iterable; typed loosely because config/settings.py imports this module)."""
    paths: dict[str, str] = {}
    base_models = {instance.model for instance in instances}
    for instance in instances:
        for name, path in instance.lora_adapters.items():
            if name in base_models:
                raise ValueError(f"LoRA adapter {name!r} of instance {instance.id} is also a base model's name")
            if paths.setdefault(name, path) != path:
                raise ValueError(f"LoRA adapter {name!r} is loaded from {paths[name]!r} and from {path!r} "
                                 f"(instance {instance.id}): the engines' block hashes differ; use one path "
                                 "or two adapter names")
