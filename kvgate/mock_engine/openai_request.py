"""Parse and validate the OpenAI request bodies a mock engine accepts.

Unknown fields are ignored on purpose: routers in front of engines (kvgate, sglang-router,
vllm-router) add their own extras, and a real vLLM ignores them too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.gateway.errors import APIError

# OpenAI's documented default for /v1/completions; used for chat too so a forgotten
# max_tokens never makes a mock engine decode for minutes.
DEFAULT_MAX_TOKENS = 16
_TOKEN_ID_LIMIT = 2**32  # the hash algorithms treat token ids as uint32


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What the engine needs from one request; exactly one of text, token_ids, messages is set."""

    chat: bool
    model: str
    max_tokens: int
    stream: bool
    include_usage: bool
    text: str | None = None
    token_ids: tuple[int, ...] | None = None
    messages: tuple[dict[str, Any], ...] | None = None


def parse_completion(body: Any, served_model: str) -> ParsedRequest:
    body = _object(body)
    prompt = _single_prompt(body.get("prompt"))
    common = _common(body, served_model, ("max_tokens",))
    if isinstance(prompt, str):
        return ParsedRequest(chat=False, text=prompt, **common)
    return ParsedRequest(chat=False, token_ids=prompt, **common)


def parse_chat(body: Any, served_model: str) -> ParsedRequest:
    body = _object(body)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{index}] must be an object with a string 'role'", param="messages")
    common = _common(body, served_model, ("max_completion_tokens", "max_tokens"))
    return ParsedRequest(chat=True, messages=tuple(messages), **common)


def _object(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _common(body: dict[str, Any], served_model: str, max_token_fields: tuple[str, ...]) -> dict[str, Any]:
    model = body.get("model", served_model)
    if model != served_model:
        raise APIError(404, f"The model `{model}` does not exist.", param="model")
    max_tokens = DEFAULT_MAX_TOKENS
    for field in max_token_fields:  # the first one present wins (chat: max_completion_tokens)
        if body.get(field) is not None:
            max_tokens = body[field]
            if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
                raise APIError(400, f"'{field}' must be a positive integer", param=field)
            break
    if body.get("n", 1) != 1:
        raise APIError(400, "only n=1 is supported", param="n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be a boolean", param="stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    return {"model": served_model, "max_tokens": max_tokens, "stream": stream,
            "include_usage": bool(options.get("include_usage", False))}


def _single_prompt(prompt: Any) -> str | tuple[int, ...]:
    """A string or a list of token ids; a batch of exactly one of those is unwrapped."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(type(t) is int and 0 <= t < _TOKEN_ID_LIMIT for t in prompt):
            return tuple(prompt)
        raise APIError(400, "'prompt' token ids must be integers in 0..2**32-1", param="prompt")
    if isinstance(prompt, list) and not prompt:
        raise APIError(400, "'prompt' must not be empty", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a batch of one of those",
                       param="prompt")
