"""What an engine feeds its chat template besides the messages, read from a chat request body.

vLLM and SGLang render a chat with `tools`, `documents`, `add_generation_prompt`,
`continue_final_message` and the free-form `chat_template_kwargs` (which override the others, as
vLLM merges them). The gateway must render with the same inputs, or its token ids, hence its block
keys, differ from the engine's from the first token a tool description changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvgate.gateway.errors import APIError

# The body fields that change the rendered text; a body with none of them renders with the defaults.
TEMPLATE_FIELDS = ("tools", "documents", "add_generation_prompt", "continue_final_message", "chat_template_kwargs")


@dataclass(frozen=True, slots=True)
class ChatTemplateInputs:
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # chat_template_kwargs

    def as_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of `apply_chat_template`, chat_template_kwargs last (they win)."""
        kwargs: dict[str, Any] = {
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }
        if self.tools is not None:
            kwargs["tools"] = self.tools
        if self.documents is not None:
            kwargs["documents"] = self.documents
        kwargs.update(self.extra)
        return kwargs


DEFAULT_INPUTS = ChatTemplateInputs()


def chat_template_inputs(body: dict[str, Any]) -> ChatTemplateInputs:
    """The template inputs of a chat body; 400 for a wrongly typed one."""
    if not any(name in body for name in TEMPLATE_FIELDS):
        return DEFAULT_INPUTS
    tools = _objects(body, "tools")
    documents = _objects(body, "documents")
    add_generation_prompt = _flag(body, "add_generation_prompt", True)
    continue_final_message = _flag(body, "continue_final_message", False)
    extra = body.get("chat_template_kwargs")
    if extra is None:
        extra = {}
    elif type(extra) is not dict:
        raise APIError(400, "invalid 'chat_template_kwargs': must be an object", param="chat_template_kwargs")
    if continue_final_message and add_generation_prompt:
        # vLLM refuses the pair too: the template cannot both close the last turn and open a new one.
        raise APIError(400, "'continue_final_message' and 'add_generation_prompt' cannot both be true",
                       param="continue_final_message")
    return ChatTemplateInputs(add_generation_prompt, continue_final_message, tools, documents, extra)


def _objects(body: dict[str, Any], name: str) -> list[dict[str, Any]] | None:
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not list or not all(type(item) is dict for item in value):
        raise APIError(400, f"invalid '{name}': must be a list of objects", param=name)
    return value


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name)
    if value is None:
        return default
    if type(value) is not bool:
        raise APIError(400, f"invalid '{name}': must be a boolean", param=name)
    return value
