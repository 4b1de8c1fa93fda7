"""The JSON bodies and SSE chunks a mock engine sends, shaped as vLLM's OpenAI server shapes them."""

from __future__ import annotations

from typing import Any

import orjson

SSE_DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> dict[str, Any]:
    """vLLM's usage object; `prompt_tokens_details` only when cached tokens are reported (vLLM needs
    --enable-prompt-tokens-details for it, SGLang --enable-cache-report)."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def _completion_choice(text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason, "stop_reason": None}


class ResponseShape:
    """Builds the bodies of one request: completion (`text`) or chat (`message` / `delta`)."""

    def __init__(self, chat: bool, request_id: str, model: str, created: int) -> None:
        self.chat = chat
        self._head = {
            "id": request_id,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created,
            "model": model,
        }
        self._object_whole = "chat.completion" if chat else "text_completion"

    def first_chunk(self, index: int) -> dict[str, Any] | None:
        """Chat streams open each choice with the assistant role and empty content; completions have no opener."""
        if not self.chat:
            return None
        return self._chunk(
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        )

    def text_chunk(self, text: str, finish_reason: str | None, index: int) -> dict[str, Any]:
        if self.chat:
            return self._chunk(
                {"index": index, "delta": {"content": text}, "logprobs": None, "finish_reason": finish_reason}
            )
        return self._chunk(_completion_choice(text, finish_reason, index))

    def usage_chunk(self, usage_body: dict[str, Any]) -> dict[str, Any]:
        return {**self._head, "choices": [], "usage": usage_body}

    def whole(self, texts: list[str], finish_reason: str, usage_body: dict[str, Any]) -> dict[str, Any]:
        """One choice per text, indexed in order."""
        choices = []
        for index, text in enumerate(texts):
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append({"index": index, "message": message, "logprobs": None, "finish_reason": finish_reason})
            else:
                choices.append(_completion_choice(text, finish_reason, index))
        return {**self._head, "object": self._object_whole, "choices": choices, "usage": usage_body}

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        return {**self._head, "choices": [choice]}
