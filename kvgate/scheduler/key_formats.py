"""Raw block hashes -> the key strings engines write into the KV store (REFERENCE.md section 2).

The gateway sees a hit only if it builds the very string an engine wrote, so the format is a
setting (`--kvs-key-format`): a preset named after the writer, or a template. Only tensor-parallel
rank 0's key is built: one rank's key is enough to know where a chunk lives. The presets and
the check of a template are config/key_formats.py's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvgate.config.key_formats import PRESET_TEMPLATES, check_key_format, template_fields
from kvgate.config.settings import HashAlgo, Settings
from kvgate.scheduler.hashing import BlockHash


@dataclass(frozen=True, slots=True)
class KeyFormat:
    """Builds the store key of each block."""

    name: str
    _key: Callable[[BlockHash], str]

    def keys(self, blocks: Sequence[BlockHash]) -> list[str]:
        return [self._key(block) for block in blocks]


def make_key_format(settings: Settings) -> KeyFormat:
    name = check_key_format(settings.kvs_key_format)
    if name == "llumnix":
        return KeyFormat(name, _llumnix_key(settings))
    if name == "iris":
        prefix = settings.kvs_iris_meta_prefix + settings.kvs_vllm_block_prefix
        return KeyFormat(name, lambda block: prefix + block.value)
    template = PRESET_TEMPLATES.get(name, name)
    model = settings.kvs_model_name.rstrip("/").rsplit("/", 1)[-1]  # vLLM keys carry the basename
    if "model" in template_fields(template) and not model:
        raise ValueError(f"key format {name!r} embeds the model name, which is not set (--kvs-model-name)")
    return KeyFormat(name, lambda block: template.format(hash=block.value, model=model, rank=0))


def _llumnix_key(settings: Settings) -> Callable[[BlockHash], str]:
    """Each algorithm's native key, as Llumnix and the engines it pairs with write them."""
    algo = settings.kvs_hash_algo
    if algo == HashAlgo.SHA256_CBOR:
        return lambda block: block.value + "_0"  # the hybrid connector's tp-rank suffix
    if algo == HashAlgo.SHA256_HEX:
        return lambda block: block.value if block.full else block.value + "_0"
    prefix = settings.kvs_iris_meta_prefix + settings.kvs_vllm_block_prefix
    return lambda block: prefix + block.value
