"""What a gateway that is one worker of `kvgate serve --workers N` takes from the others: the
interface the workers room (kvgate/workers/worker.py) implements, so the gateway never imports it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from aiohttp import web

    from kvgate.config.settings import InstanceConfig
    from kvgate.gateway.fleet.registry import InstanceRegistry
    from kvgate.gateway.http.key_limits import KeyLimit
    from kvgate.scheduler.account import AccountRows


class WorkerShare(Protocol):
    @property
    def leader(self) -> bool:
        """The one worker that runs health checks, engine-stats scraping, the account sync and discovery."""

    @property
    def rows(self) -> AccountRows:
        """The account rows every worker reads and writes."""

    @property
    def events_index_path(self) -> str:
        """The KV-events index the supervisor's subscriber writes; empty when events are off."""

    def registry(self, on_change: Callable[[tuple[InstanceConfig, ...]], None]) -> InstanceRegistry:
        """The instance registry over the workers' shared table."""

    async def tag_response(self, request: web.Request, response: web.StreamResponse) -> None:
        """Names the answering worker on every response."""

    def whole_metrics(self, registry: InstanceRegistry) -> bytes:
        """/metrics of the whole gateway (every worker's series), in Prometheus' text format."""

    def key_limit(self, digest: bytes, rate: float, burst: int, now: float) -> KeyLimit | None:
        """The limits of the API key with this SHA-256 digest, counted by every worker (a bucket of
        `rate` and `burst`, full at `now` when the key is new); None when there is no room for it."""
