"""An Envoy bootstrap that puts kvgate's endpoint picker in front of the engines, as llm-d and the
Gateway API Inference Extension run it: the ext_proc filter with FULL_DUPLEX_STREAMED bodies, and an
ORIGINAL_DST cluster that connects to the address the picker names in `x-gateway-destination-endpoint`.

It is the configuration docs/EPP.md describes, complete: the tests (tests/envoy_proxy.py) and
`kvgate bench overhead --epp` start a real Envoy 1.40 with it (kvgate.bench.envoy.ENVOY_PACKAGE).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.gateway.ext_proc.messages import DESTINATION_HEADER, SUBSET_KEY, SUBSET_NAMESPACE

PICKER_CLUSTER = "epp"
ENGINES_CLUSTER = "engines"


def _ext_proc_filter() -> dict:
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": PICKER_CLUSTER}, "timeout": "10s"},
            # True would route without the picker when it is down, which FULL_DUPLEX_STREAMED breaks.
            "failure_mode_allow": False,
            # The body is planned only once complete: allow for tokenizing.
            "message_timeout": "30s",
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            "metadata_options": {"forwarding_namespaces": {"untyped": [SUBSET_NAMESPACE]}},
        },
    }


def _subset_hint_filter(subset: Sequence[str]) -> dict:
    """Sets the subset hint a gateway passes when it restricts the pick (e.g. to ready endpoints)."""
    return {
        "name": "envoy.filters.http.set_metadata",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": SUBSET_NAMESPACE, "value": {SUBSET_KEY: list(subset)}}],
        },
    }


def _http2_options() -> dict:
    """gRPC needs HTTP/2 to the picker."""
    return {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {}},
    }}


def bootstrap(listen_host: str, listen_port: int, picker_address: str,
              subset: Sequence[str] | None = None) -> dict:
    """Envoy's static bootstrap: a listener on listen_host:listen_port whose every request the picker
    at `picker_address` ("IP:PORT") routes. With `subset`, Envoy passes it as the subset hint."""
    picker_host, _, picker_port = picker_address.rpartition(":")
    filters = [_ext_proc_filter(), {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    if subset is not None:
        filters.insert(0, _subset_hint_filter(subset))
    connection_manager = {
        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                 "HttpConnectionManager",
        "stat_prefix": "inference",
        "route_config": {"virtual_hosts": [{
            "name": "all", "domains": ["*"],
            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": ENGINES_CLUSTER, "timeout": "300s"}}],
        }]},
        "http_filters": filters,
    }
    return {"static_resources": {
        "listeners": [{
            "name": "inference",
            "address": {"socket_address": {"address": listen_host, "port_value": listen_port}},
            "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                            "typed_config": connection_manager}]}],
        }],
        "clusters": [
            {
                "name": ENGINES_CLUSTER,
                "type": "ORIGINAL_DST",
                "lb_policy": "CLUSTER_PROVIDED",
                "connect_timeout": "1s",
                "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
            },
            {
                "name": PICKER_CLUSTER,
                "type": "STATIC",
                "connect_timeout": "1s",
                "typed_extension_protocol_options": _http2_options(),
                "load_assignment": {"cluster_name": PICKER_CLUSTER, "endpoints": [{"lb_endpoints": [{"endpoint": {
                    "address": {"socket_address": {"address": picker_host, "port_value": int(picker_port)}}}}]}]},
            },
        ],
    }}
