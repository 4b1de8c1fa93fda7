"""The scheduler as the gateway and the simulator use it: hashing, keys, hits and the policy, wired
from the settings. It holds no I/O and no load: callers ask the store and build the candidates.
"""

from __future__ import annotations

import random
from collections.abc import Collection, Mapping, Sequence

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.scheduler.decode import DecodeChooser, PDDecision
from kvgate.scheduler.hashing import BlockHash, hash_blocks
from kvgate.scheduler.key_formats import make_key_format
from kvgate.scheduler.policies import make_policy
from kvgate.scheduler.prefix import EndpointMap, prefix_hit_tokens
from kvgate.scheduler.types import Candidate, Decision, RoutingRequest


class Scheduler:
    def __init__(
        self, settings: Settings, instances: Sequence[InstanceConfig], rng: random.Random | None = None
    ) -> None:
        self._settings = settings
        self._key_format = make_key_format(settings)
        self.policy = make_policy(settings, rng)
        self.endpoint_map = EndpointMap.from_instances(instances)
        self._decode = DecodeChooser()

    def block_hashes(self, token_ids: Sequence[int]) -> list[BlockHash]:
        s = self._settings
        return hash_blocks(
            s.kvs_hash_algo, token_ids, s.kvs_chunk_size, s.kvs_enable_save_unfull_chunk, s.hash_seed
        )

    def block_keys(self, blocks: Sequence[BlockHash]) -> list[str]:
        return self._key_format.keys(blocks)

    def wants_kvs(self, num_prompt_tokens: int) -> bool:
        """Whether asking the store can change the decision for a prompt this long."""
        return self.policy.uses_cache(num_prompt_tokens)

    def decide(
        self,
        num_prompt_tokens: int,
        blocks: Sequence[BlockHash],
        locations: Sequence[Collection[str]] | None,
        candidates: Sequence[Candidate],
    ) -> Decision:
        """Rank `candidates`. `locations` None means the store did not answer: no hits, load only."""
        hits: dict[str, int] = {}
        if locations is not None and self.wants_kvs(num_prompt_tokens):
            hits = prefix_hit_tokens(blocks, locations, self.endpoint_map, num_prompt_tokens)
        return self.policy.select(RoutingRequest(num_prompt_tokens, hits), candidates)

    @property
    def pd_enabled(self) -> bool:
        """Whether models with prefill and decode instances are served disaggregated."""
        return self._settings.pd_protocol is not None

    def decide_pd(
        self,
        num_prompt_tokens: int,
        blocks: Sequence[BlockHash],
        locations: Sequence[Collection[str]] | None,
        prefill_candidates: Sequence[Candidate],
        decode_candidates: Sequence[Candidate],
        predicted_decode_tokens: Mapping[str, int],
    ) -> PDDecision:
        """Both halves of a disaggregated request: the configured policy over the prefill instances,
        decode load over the decode instances (scheduler/decode.py)."""
        prefill = self.decide(num_prompt_tokens, blocks, locations, prefill_candidates)
        decode = self._decode.choose(RoutingRequest(num_prompt_tokens), decode_candidates, predicted_decode_tokens)
        # The decode instance prefills a skipped request itself: what it misses is what it computes.
        decode_hit = 0
        if locations is not None and decode.selected is not None:
            decode_hit = prefix_hit_tokens(blocks, locations, self.endpoint_map, num_prompt_tokens).get(
                decode.selected, 0)
        miss = max(0, num_prompt_tokens - decode_hit)
        threshold = self._settings.pd_skip_prefill_below_tokens
        return PDDecision(prefill, decode, skip_prefill=bool(threshold) and miss <= threshold,
                          decode_miss_tokens=miss)

    def set_instances(self, instances: Sequence[InstanceConfig]) -> None:
        """Instances added or removed at run time: their store endpoints change with them."""
        self.endpoint_map = EndpointMap.from_instances(instances)
