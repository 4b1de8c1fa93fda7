"""Learn each engine's context length from its `/v1/models`, for instances whose config names none.

vLLM and SGLang report `max_model_len` there. Knowing it, the gateway answers an over-long prompt
itself with OpenAI's 400 (prompt_limit.py), the same answer whatever the prompt's form, instead of
spending a tokenize, a lookup and a round trip on a request the engine refuses with its own wording.
An engine that is down or reports no figure is asked again on the next round; a figure, once learned,
is kept until the instance leaves the fleet. Every worker learns for itself: one GET per engine.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp

from kvgate.gateway.fleet.registry import InstanceRegistry
from kvgate.gateway.planning.prompt_limit import PromptLimit

log = logging.getLogger(__name__)

# A context length beyond this is not one (a placeholder or a broken answer); it is ignored.
_MAX_PLAUSIBLE_CONTEXT = 1 << 31


class EngineContextProbe:
    def __init__(self, registry: InstanceRegistry, session: aiohttp.ClientSession, limit: PromptLimit,
                 timeout_s: float) -> None:
        self._registry = registry
        self._session = session
        self._limit = limit
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def learn_all(self) -> None:
        pending = [s.config for s in self._registry.states()
                   if s.config.max_model_len is None and not self._limit.learned(s.id)]
        found = await asyncio.gather(*(self._ask(c.url, c.model) for c in pending))
        for config, max_model_len in zip(pending, found, strict=True):
            if max_model_len is not None and self._registry.get(config.id) is not None:
                log.info("instance %s serves %s with max_model_len %d", config.id, config.model, max_model_len)
                self._limit.learn(config.id, config.model, max_model_len)

    async def _ask(self, url: str, model: str) -> int | None:
        try:
            async with self._session.get(url.rstrip("/") + "/v1/models", timeout=self._timeout) as response:
                if response.status != 200:
                    return None
                answer = await response.json(content_type=None)
        except (OSError, aiohttp.ClientError, TimeoutError, ValueError):
            return None
        entries = answer.get("data") if isinstance(answer, dict) else None
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("id") == model:
                value = entry.get("max_model_len")
                if type(value) is int and 0 < value < _MAX_PLAUSIBLE_CONTEXT:
                    return value
        return None
