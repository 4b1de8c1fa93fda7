"""The OpenAI request bodies the gateway reads, validated with pydantic.

Only what routing needs is declared (model, prompt or messages, stream); every other field is
allowed and forwarded untouched, because engines accept many extensions (vLLM sampling options,
SGLang's extras) the gateway has no business filtering. Types are strict: "12" is not a token id.
The fields that shape scheduling or the relay (`max_tokens`, `max_completion_tokens`, `n`,
`stream_options`) are type-checked too, one function per field (`check_shaping_fields`), so a
wrong type is a clear 400 here rather than an engine's error after routing.

Every request pays for parsing, so the usual shapes (a text or token-id prompt, text chat
messages) are recognised by a few type checks first; pydantic validates everything else and
writes the error messages. The quick check only ever accepts bodies pydantic accepts
(tests/gateway/test_gateway_protocol.py checks it on generated bodies).
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
    def _prompt_or_batch(cls, prompt: Any) -> list[str | list[int]]:
        """A string, token ids, or a batch (a list of either): returned as the list of prompts."""
        batch = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]
        for one in batch:
            if not (isinstance(one, str) or (isinstance(one, list) and _token_ids(one))):
                raise ValueError("must be a string, a list of token ids (integers in 0..2**32-1), "
                                 "or a list of either")
            if not one:
                raise ValueError("must not be empty")
        # As OpenAI and vLLM type it: strings or token-id lists, not both (an engine reads the
        # batch as one kind, and the gateway routes it on its first prompt as that kind).
        if any(type(one) is not type(batch[0]) for one in batch):
            raise ValueError("a batch must be all strings or all lists of token ids, not both")
        return batch


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
    # For a batched completion they hold the first prompt, which routes the batch (see `batch`).
    prompt_text: str | None = None
    prompt_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    # Every prompt of a batched completion (more than one), in order; None for a single prompt.
    batch: list[str] | list[list[int]] | None = None

    @property
    def max_tokens(self) -> int | None:
        """max_completion_tokens, else max_tokens (both checked by check_shaping_fields); None when
        neither is sent. The rejection filter's estimate of the decode the request will cost."""
        value = self.body.get("max_completion_tokens")
        return value if value is not None else self.body.get("max_tokens")


def parse_completion(raw: bytes) -> ParsedRequest:
    body = _json_object(raw)
    model, stream, prompt = body.get("model"), body.get("stream", False), body.get("prompt")
    if type(model) is str and model and type(stream) is bool and prompt:
        if type(prompt) is str:
            check_shaping_fields(body, stream)
            return ParsedRequest(False, model, stream, body, raw, prompt_text=prompt)
        if type(prompt) is list and type(prompt[0]) is int and _token_ids(prompt):
            check_shaping_fields(body, stream)
            return ParsedRequest(False, model, stream, body, raw, prompt_ids=prompt)
    return validated_completion(body, raw)


def parse_chat(raw: bytes) -> ParsedRequest:
    body = _json_object(raw)
    model, stream, messages = body.get("model"), body.get("stream", False), body.get("messages")
    if (type(model) is str and model and type(stream) is bool and type(messages) is list and messages
            and all(type(m) is dict and type(m.get("role")) is str and m["role"]
                    and (m.get("content") is None or type(m["content"]) is str) for m in messages)):
        check_shaping_fields(body, stream)
        return ParsedRequest(True, model, stream, body, raw, messages=messages)
    return validated_chat(body, raw)


def validated_completion(body: dict[str, Any], raw: bytes) -> ParsedRequest:
    """The full validation (pydantic), for bodies the quick check in parse_completion did not accept."""
    request = _validate(CompletionBody, body)
    check_shaping_fields(body, request.stream)
    prompts = request.prompt
    batch = prompts if len(prompts) > 1 else None
    first = prompts[0]
    if isinstance(first, str):
        return ParsedRequest(False, request.model, request.stream, body, raw, prompt_text=first, batch=batch)
    return ParsedRequest(False, request.model, request.stream, body, raw, prompt_ids=first, batch=batch)


def validated_chat(body: dict[str, Any], raw: bytes) -> ParsedRequest:
    """The full validation (pydantic), for bodies the quick check in parse_chat did not accept."""
    request = _validate(ChatBody, body)
    check_shaping_fields(body, request.stream)
    return ParsedRequest(True, request.model, request.stream, body, raw, messages=body["messages"])


# --- the fields that shape scheduling and the relay: one check per field ---

# OpenAI's own maximum. Engines take any n: one request with a huge n keeps an engine busy making
# its samples (a mock engine's memory grew by gigabytes a second), the health checks then eject it,
# and the forwarder retries the request on the next instance, and so on through the fleet.
MAX_N = 128

def check_shaping_fields(body: dict[str, Any], stream: bool) -> None:
    """400 for a wrongly typed max_tokens, max_completion_tokens, n or stream_options (absent or
    null means the engine's default). Everything else passes through unchecked."""
    for field in ("max_tokens", "max_completion_tokens"):
        check_max_tokens(body, field)
    check_n(body)
    check_stream_options(body, stream)


def check_max_tokens(body: dict[str, Any], field: str) -> None:
    value = body.get(field)
    if value is not None and (type(value) is not int or value < 1):
        raise APIError(400, f"invalid '{field}': must be a positive integer", param=field)


def check_n(body: dict[str, Any]) -> None:
    value = body.get("n")
    if value is not None and (type(value) is not int or not 1 <= value <= MAX_N):
        raise APIError(400, f"invalid 'n': must be a positive integer, at most {MAX_N}", param="n")


def add_special_tokens(body: dict[str, Any], chat: bool) -> bool:
    """vLLM's `add_special_tokens`: BOS/EOS around the text; by default on for completions, off for
    chats (their template writes them). It changes the token ids, so the gateway follows it too."""
    value = body.get("add_special_tokens")
    if value is None:
        return not chat
    if type(value) is not bool:
        raise APIError(400, "invalid 'add_special_tokens': must be a boolean", param="add_special_tokens")
    return value


def check_stream_options(body: dict[str, Any], stream: bool) -> None:
    """An object, only with `stream: true` (as OpenAI and vLLM rule); `include_usage` a boolean."""
    options = body.get("stream_options")
    if options is None:
        return
    if type(options) is not dict:
        raise APIError(400, "invalid 'stream_options': must be an object", param="stream_options")
    if not stream:
        raise APIError(400, "invalid 'stream_options': only allowed when 'stream' is true", param="stream_options")
    for flag in ("include_usage", "continuous_usage_stats"):
        if flag in options and type(options[flag]) is not bool:
            raise APIError(400, f"invalid 'stream_options.{flag}': must be a boolean", param="stream_options")


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
