"""The OpenAI request bodies the gateway reads, validated with pydantic.

Only what routing needs is declared (model, prompt or messages, stream); every other field is
allowed and forwarded untouched, because engines accept many extensions (vLLM sampling options,
SGLang's extras) the gateway has no business filtering. Types are strict: "12" is not a token id.

Every request pays for parsing, so the usual shapes (a text or token-id prompt, text chat
messages) are recognised by a few type checks first; pydantic validates everything else and
writes the error messages. The quick check only ever accepts bodies pydantic accepts
(tests/test_gateway_protocol.py checks it on generated bodies).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import orjson
from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictStr, ValidationError, field_validator

from kvgate.gateway.errors import APIError

# Every hash algorithm treats token ids as uint32.
_TOKEN_ID_LIMIT = 2**32


class _OpenAIBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Annotated[StrictStr, Field(min_length=1)]
    stream: StrictBool = False


class CompletionBody(_OpenAIBody):
    prompt: Any

    @field_validator("prompt")
    @classmethod
    def _single_prompt(cls, prompt: Any) -> str | list[int]:
        """A string or token ids; a batch of one is unwrapped, real batches refused (one decision each)."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise ValueError("batched prompts are not supported: send one prompt per request")
            prompt = prompt[0]
        if isinstance(prompt, str) or (isinstance(prompt, list) and _token_ids(prompt)):
            if not prompt:
                raise ValueError("must not be empty")
            return prompt
        raise ValueError("must be a string or a list of token ids (integers in 0..2**32-1)")


def _token_ids(values: list) -> bool:
    return all(type(t) is int and 0 <= t < _TOKEN_ID_LIMIT for t in values)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Annotated[StrictStr, Field(min_length=1)]
    content: Any = None

    @field_validator("content")
    @classmethod
    def _text_or_parts(cls, content: Any) -> Any:
        if content is None or isinstance(content, str):
            return content
        if isinstance(content, list) and all(isinstance(part, dict) for part in content):
            return content
        raise ValueError("must be a string, a list of content parts, or null")


class ChatBody(_OpenAIBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """A validated request: the JSON to forward and what routing reads from it."""

    chat: bool
    model: str
    stream: bool
    body: dict[str, Any]
    raw: bytes  # forwarded as is unless the gateway must change the body
    # Exactly one of these is set: prompt text, prompt token ids, or chat messages (as sent).
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # max_completion_tokens, else max_tokens (None when neither is sent): the rejection filter's
    # estimate of the decode it will cost.
    max_tokens: int | None = None


def parse_completion(raw: bytes) -> ParsedRequest:
    body = _json_object(raw)
    max_tokens = _max_tokens(body)
    model, stream, prompt = body.get("model"), body.get("stream", False), body.get("prompt")
    if type(model) is str and model and type(stream) is bool and prompt:
        if type(prompt) is str:
            return ParsedRequest(False, model, stream, body, raw, prompt_text=prompt, max_tokens=max_tokens)
        if type(prompt) is list and type(prompt[0]) is int and _token_ids(prompt):
            return ParsedRequest(False, model, stream, body, raw, prompt_ids=prompt, max_tokens=max_tokens)
    return validated_completion(body, raw)


def parse_chat(raw: bytes) -> ParsedRequest:
    body = _json_object(raw)
    max_tokens = _max_tokens(body)
    model, stream, messages = body.get("model"), body.get("stream", False), body.get("messages")
    if (type(model) is str and model and type(stream) is bool and type(messages) is list and messages
            and all(type(m) is dict and type(m.get("role")) is str and m["role"]
                    and (m.get("content") is None or type(m["content"]) is str) for m in messages)):
        return ParsedRequest(True, model, stream, body, raw, messages=messages, max_tokens=max_tokens)
    return validated_chat(body, raw)


def validated_completion(body: dict[str, Any], raw: bytes) -> ParsedRequest:
    """The full validation (pydantic), for bodies the quick check in parse_completion did not accept."""
    request = _validate(CompletionBody, body)
    prompt, max_tokens = request.prompt, _max_tokens(body)
    if isinstance(prompt, str):
        return ParsedRequest(False, request.model, request.stream, body, raw, prompt_text=prompt,
                             max_tokens=max_tokens)
    return ParsedRequest(False, request.model, request.stream, body, raw, prompt_ids=prompt,
                         max_tokens=max_tokens)


def validated_chat(body: dict[str, Any], raw: bytes) -> ParsedRequest:
    """The full validation (pydantic), for bodies the quick check in parse_chat did not accept."""
    request = _validate(ChatBody, body)
    return ParsedRequest(True, request.model, request.stream, body, raw, messages=body["messages"],
                         max_tokens=_max_tokens(body))


def _max_tokens(body: dict[str, Any]) -> int | None:
    """max_completion_tokens (the newer name) else max_tokens; a non-integer or negative one is a 400."""
    value = None
    for name in ("max_tokens", "max_completion_tokens"):
        given = body.get(name)
        if given is None:
            continue
        if type(given) is not int or given < 0:
            raise APIError(400, f"invalid '{name}': must be a non-negative integer", param=name)
        value = given
    return value


def _json_object(raw: bytes) -> dict[str, Any]:
    if not raw:
        raise APIError(400, "the request body is empty; expected a JSON object")
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    return body


def _validate(model: type[BaseModel], body: dict[str, Any]) -> Any:
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        location = ".".join(str(part) for part in first["loc"])
        param = str(first["loc"][0]) if first["loc"] else None
        message = first["msg"].removeprefix("Value error, ")
        raise APIError(400, f"invalid '{location}': {message}", param=param) from None


def json_response(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(payload), status=status, content_type="application/json")
