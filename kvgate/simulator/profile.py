"""The simulated instance behind each trace replay: the engine model with the trace's blocks."""

from __future__ import annotations

import dataclasses

from kvgate.engine_model import ServiceProfile
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS

# Reusable KV cache per instance, in 512-token blocks: the GPU's HBM (832 blocks, ~426K tokens: what
# an 80 GB GPU leaves for an 8B model at 128 KiB/token) plus the host DRAM the instance contributes
# to the Mooncake store (7x that, ~3M tokens, ~380 GB), which its connector loads back instead of
# recomputing (Llumnix hybrid connector, SGLang HiCache L2/L3). Mooncake's trace comes from such a
# deployment; HBM alone (--cache-capacity-blocks 832) caps every policy far below the ideal.
HBM_BLOCKS = 832
DEFAULT_CACHE_BLOCKS = 8 * HBM_BLOCKS
# `kvgate simulate --store-model` (see simulator/replay.py): one shared pool, or a cache per instance.
STORE_MODELS = ("shared", "local")


def hbm_blocks(cache_capacity_blocks: int) -> int:
    """The HBM part of an instance's cache under the shared store model: the default's ratio
    (832 of 6656 blocks), the rest being its DRAM segment."""
    return max(1, cache_capacity_blocks * HBM_BLOCKS // DEFAULT_CACHE_BLOCKS)


def trace_profile(cache_capacity_blocks: int = DEFAULT_CACHE_BLOCKS) -> ServiceProfile:
    """The default simulated GPU (engine_model.profile) with the trace's 512-token blocks.

    A conversation returns after ~2 minutes (the median gap between a block's uses), during which
    one instance sees ~1/8 of ~3.4 req/s x 12K tokens ~ 600K tokens, so even with the host tier
    placement decides what stays.
    """
    profile = ServiceProfile().with_block_size(TRACE_BLOCK_TOKENS)
    return dataclasses.replace(profile, cache_capacity_blocks=cache_capacity_blocks)
