"""The store key formats a user may name (`--kvs-key-format`) and the check of a template.

The presets live here, with the settings, so that validating a configuration needs nothing
outside config/; scheduler/key_formats.py builds the keys from them (REFERENCE.md section 2).
"""

from __future__ import annotations

import string

# Fields a template may use besides the required {hash}.
TEMPLATE_FIELDS = frozenset({"hash", "model", "rank"})
PRESETS = ("llumnix", "sglang_mha", "sglang_mla", "vllm_mooncake", "iris")
# Presets that are plain templates; "llumnix" and "iris" depend on the hash algorithm and prefixes.
PRESET_TEMPLATES = {
    "sglang_mha": "{hash}_{rank}_k",  # SGLang HiCache, MHA models (the K half)
    "sglang_mla": "{hash}__k",  # SGLang HiCache, MLA models
    "vllm_mooncake": "{model}@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:0@{hash}",  # vLLM MooncakeStoreConnector
}


def check_key_format(key_format: str) -> str:
    """Return `key_format` if it is a preset or a usable template, else raise ValueError saying why."""
    if key_format in PRESETS:
        return key_format
    fields = template_fields(key_format)
    if "hash" not in fields:
        raise ValueError(
            f"unknown key format {key_format!r}: use a preset ({', '.join(PRESETS)}) "
            "or a template containing {hash}"
        )
    unknown = fields - TEMPLATE_FIELDS
    if unknown:
        raise ValueError(
            f"key format template {key_format!r} uses unknown field(s) {sorted(unknown)}; "
            f"allowed: {sorted(TEMPLATE_FIELDS)}"
        )
    return key_format


def template_fields(template: str) -> set[str]:
    try:
        return {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise ValueError(f"key format template {template!r} is malformed: {exc}") from None
