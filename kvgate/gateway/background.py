"""Periodic background jobs (health checks, stats scraping, account expiry) with one shape."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def every(interval_s: float, job: Callable[[], Awaitable[None]], name: str) -> None:
    """Run `job` now and then every `interval_s` until cancelled; a failing run is logged, not fatal."""
    while True:
        try:
            await job()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background job %s failed; retrying in %.1fs", name, interval_s)
        await asyncio.sleep(interval_s)
