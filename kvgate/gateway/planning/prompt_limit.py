"""The longest prompt the gateway accepts for a model, in tokens; longer ones get a 400.

A prompt no engine can hold is refused before it costs the gateway memory (token ids, hashes,
keys) and a round trip to an engine that would refuse it anyway. The limit, in order:
- `--max-prompt-tokens` when set (> 0), for every model;
- else the largest `max_model_len` among the model's instances (vLLM's --max-model-len, SGLang's
  --context-length), when any instance declares one or reported one in /v1/models (engine_context.py);
- else the tokenizer's `model_max_length`, when it is a real figure (Hugging Face writes 1e30
  when a tokenizer does not know its context);
- else FALLBACK_MAX_PROMPT_TOKENS.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config.settings import InstanceConfig
from kvgate.gateway.errors import APIError

FALLBACK_MAX_PROMPT_TOKENS = 1 << 20  # the longest contexts served today
# Above this, a tokenizer's model_max_length is a "don't know" placeholder, not a context length.
_PLAUSIBLE_CONTEXT = 100_000_000


class PromptLimit:
    def __init__(self, configured: int, tokenizer: object, instances: Sequence[InstanceConfig]) -> None:
        self._configured = configured
        tokenizer_max = getattr(tokenizer, "model_max_length", None)
        plausible = isinstance(tokenizer_max, int) and 0 < tokenizer_max <= _PLAUSIBLE_CONTEXT
        self._default = tokenizer_max if plausible else FALLBACK_MAX_PROMPT_TOKENS
        self._by_model: dict[str, int] = {}
        self._instances: Sequence[InstanceConfig] = ()
        # instance id -> (model, max_model_len) its engine reported, for instances configured without one.
        self._learned: dict[str, tuple[str, int]] = {}
        self.set_instances(instances)

    def set_instances(self, instances: Sequence[InstanceConfig]) -> None:
        self._instances = instances
        present = {instance.id: instance.model for instance in instances}
        self._learned = {i: learned for i, learned in self._learned.items() if present.get(i) == learned[0]}
        by_model: dict[str, int] = {}
        for instance in instances:
            length = instance.max_model_len
            if length is None and instance.id in self._learned:
                length = self._learned[instance.id][1]
            if length is not None:
                by_model[instance.model] = max(by_model.get(instance.model, 0), length)
        self._by_model = by_model

    def learn(self, instance_id: str, model: str, max_model_len: int) -> None:
        """An engine's own figure, for an instance whose config names none."""
        self._learned[instance_id] = (model, max_model_len)
        self.set_instances(self._instances)

    def learned(self, instance_id: str) -> bool:
        return instance_id in self._learned

    def tokens(self, model: str) -> int:
        if self._configured:
            return self._configured
        return self._by_model.get(model, self._default)


def prompt_too_long(model: str, tokens: int, limit: int, param: str) -> APIError:
    """OpenAI's answer to an over-long prompt (its wording and code)."""
    return APIError(400, f"This model's maximum context length is {limit} tokens. However, your prompt has "
                         f"at least {tokens} tokens. Shorten it (the gateway's limit for '{model}' is "
                         "--max-prompt-tokens or the instances' max_model_len).",
                    param=param, code="context_length_exceeded")
