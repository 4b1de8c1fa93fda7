"""Read what a mock engine needs from an OpenAI request body.

The prompt, messages, model and stream flag are validated by the gateway's own parser (one set of
rules for what a valid request is); this module adds the generation fields only an engine reads.
Unknown fields are ignored on purpose: routers in front of engines (kvgate, sglang-router,
vllm-router) add their own extras, and a real vLLM ignores them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import ParsedRequest, parse_chat, parse_completion

# OpenAI's documented default for /v1/completions; used for chat too so a forgotten
# max_tokens never makes a mock engine decode for minutes.
DEFAULT_MAX_TOKENS = 16


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    parsed: ParsedRequest
    max_tokens: int
    include_usage: bool
    n: int  # completions per prompt


def parse_served(raw: bytes, chat: bool, served_model: str) -> ParsedRequest:
    """The gateway's parse of the body, refused with vLLM's 404 when it names another model."""
    parsed = parse_chat(raw) if chat else parse_completion(raw)
    if parsed.model != served_model:
        raise APIError(404, f"The model `{parsed.model}` does not exist.", param="model")
    return parsed


def parse_generation(raw: bytes, chat: bool, served_model: str) -> GenerationRequest:
    parsed = parse_served(raw, chat, served_model)
    body = parsed.body
    # Chat prefers the newer name; the first one present wins.
    fields = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    max_tokens = DEFAULT_MAX_TOKENS
    for field in fields:
        if body.get(field) is not None:
            max_tokens = _positive_int(body[field], field)
            break
    # Types were checked by the parser (n a positive integer up to MAX_N, stream_options an object).
    n = body.get("n") or 1
    options: Any = body.get("stream_options") or {}
    return GenerationRequest(parsed, max_tokens, bool(options.get("include_usage", False)), n)


def _positive_int(value: Any, field: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise APIError(400, f"'{field}' must be a positive integer", param=field)
    return value
