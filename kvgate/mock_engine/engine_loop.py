"""Drive an EngineCore in real time and hand each request its events.

One task steps the core: it takes a step, then waits the step's modelled duration times the time
scale (the wait stands for the GPU computing the batch the core scheduled; the queue and the batch
are real), then delivers what the step produced to the requests' event queues. Requests that
arrive during a step join at the next one, as on a real engine.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvgate.engine_model import EngineCore, EngineRequest, StepOutcome

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """`num_tokens` new output tokens for one request; `finished` on its last event."""

    num_tokens: int
    finished: bool
    cached_tokens: int


class RequestStream:
    """The events of one submitted request, in order."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        self.cached_tokens = 0

    async def next_event(self) -> TokenEvent:
        return await self.queue.get()


class EngineLoop:
    def __init__(self, core: EngineCore, time_scale: float, on_step_done: Callable[[], None] | None = None) -> None:
        if time_scale < 0:
            raise ValueError("time_scale must be >= 0")
        self.core = core
        self._time_scale = time_scale
        # Called once a step's modelled time has passed, before its tokens are delivered.
        self._on_step_done = on_step_done
        self._streams: dict[str, RequestStream] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._started = time.monotonic()

    def model_now(self) -> float:
        """The core's clock: real seconds since start, in the model's time (divided by the scale)."""
        elapsed = time.monotonic() - self._started
        return elapsed / self._time_scale if self._time_scale else elapsed

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-loop")
        self._task.add_done_callback(_log_crash)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None

    def submit(self, request: EngineRequest) -> RequestStream:
        """Queue a request; raises ValueError if the core refuses it (it can never fit)."""
        self.core.submit(request, self.model_now())
        stream = RequestStream(request.request_id)
        self._streams[request.request_id] = stream
        self._wake.set()
        return stream

    def cancel(self, request_id: str) -> None:
        """Forget a request (client gone): its slot, pins and memory return to the engine now."""
        if self._streams.pop(request_id, None) is not None:
            self.core.cancel(request_id)

    @property
    def num_open_requests(self) -> int:
        return len(self._streams)

    async def _run(self) -> None:
        core = self.core
        while True:
            if not core.has_work():
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            outcome = core.step(self.model_now())
            if outcome.num_steps == 0:
                # Nothing runs and nothing could be admitted: only an arrival can change that.
                self._wake.clear()
                await self._wake.wait()
                continue
            delay = started + outcome.duration_s * self._time_scale - time.monotonic()
            # Yield to the handlers even for an instant step, so a busy engine never starves the loop.
            await asyncio.sleep(max(0.0, delay))
            if self._on_step_done is not None:
                self._on_step_done()
            self._deliver(outcome)

    def _deliver(self, outcome: StepOutcome) -> None:
        streams = self._streams
        for request_id, cached in outcome.cached_tokens.items():
            stream = streams.get(request_id)
            if stream is not None:
                stream.cached_tokens = cached
        finished = set(outcome.finished)
        for request_id in outcome.first_tokens:
            self._emit(streams.get(request_id), 1, request_id in finished)
        for request_id in outcome.tokens:
            self._emit(streams.get(request_id), outcome.num_steps, request_id in finished)
        for request_id in finished:
            streams.pop(request_id, None)

    @staticmethod
    def _emit(stream: RequestStream | None, num_tokens: int, finished: bool) -> None:
        if stream is None:  # cancelled while its step was running
            return
        stream.queue.put_nowait(TokenEvent(num_tokens, finished, stream.cached_tokens))


def _log_crash(task: asyncio.Task[None]) -> None:
    # A step that raises is a bug in the model; say so loudly instead of leaving requests hanging silently.
    if not task.cancelled() and task.exception() is not None:
        logger.error("engine loop stopped", exc_info=task.exception())
