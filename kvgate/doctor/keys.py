"""Block keys for the store check: the gateway's own, and the variants that name a mismatch.

When the store does not hold the gateway's keys for a prompt the engine just computed, the keys the
engine wrote may still be found under another algorithm, chunk size or key format kvgate knows:
then that setting is the cause. A different hash seed cannot be enumerated, so when no variant is
found either, the seed (or an engine that writes nothing) is what remains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.config.key_formats import PRESETS
from kvgate.config.settings import HashAlgo, Settings
from kvgate.scheduler.hashing import hash_blocks
from kvgate.scheduler.key_formats import make_key_format

# Engines' usual block / page sizes (vLLM's default 16, Llumnix's 256, ...).
_CHUNK_SIZES = (16, 32, 64, 128, 256, 512, 1024)
# Two chained blocks prove a variant: the second key depends on the first and on the seed.
_VARIANT_BLOCKS = 2


def gateway_keys(settings: Settings, token_ids: Sequence[int]) -> list[str]:
    """The store keys of the prompt's full blocks, as the gateway looks them up."""
    blocks = hash_blocks(settings.kvs_hash_algo, token_ids, settings.kvs_chunk_size, seed=settings.hash_seed)
    return make_key_format(settings).keys(blocks)


@dataclass(frozen=True, slots=True)
class KeyVariant:
    differences: dict[str, str]  # setting -> the value that finds the engine's keys
    keys: list[str]


def key_variants(settings: Settings, token_ids: Sequence[int], served_model: str) -> list[KeyVariant]:
    """Every other algorithm x chunk size x key format x seed ("0" too, the engines' default) x model
    name in the key (the configured one, or the model the instance serves)."""
    current = _hashing(settings)
    seen: set[tuple[str, ...]] = set()
    variants = []
    for algo in HashAlgo:
        for chunk in _CHUNK_SIZES:
            if chunk * _VARIANT_BLOCKS > len(token_ids):
                continue
            head = token_ids[: chunk * _VARIANT_BLOCKS]
            for seed in dict.fromkeys((settings.hash_seed, "0")):
                blocks = hash_blocks(algo, head, chunk, seed=seed)
                for key_format in PRESETS:
                    for model in dict.fromkeys((settings.kvs_model_name, served_model)):
                        variant = settings.model_copy(update={
                            "kvs_hash_algo": algo, "kvs_chunk_size": chunk, "kvs_key_format": key_format,
                            "hash_seed": seed, "kvs_model_name": model})
                        try:
                            keys = make_key_format(variant).keys(blocks)
                        except ValueError:  # a format embedding the model name, with none configured
                            continue
                        # Formats without the model name give the same keys for every model: once.
                        if tuple(keys) in seen:
                            continue
                        seen.add(tuple(keys))
                        differences = {k: v for k, v in _hashing(variant).items() if current[k] != v}
                        if differences:
                            variants.append(KeyVariant(differences, keys))
    return variants


def _hashing(settings: Settings) -> dict[str, str]:
    """The settings a block key depends on, as the config writes them."""
    return {"kvs_hash_algo": settings.kvs_hash_algo.value, "kvs_chunk_size": str(settings.kvs_chunk_size),
            "kvs_key_format": settings.kvs_key_format, "hash_seed": settings.hash_seed,
            "kvs_model_name": settings.kvs_model_name}
