"""The scheduler as the gateway and the simulator use it: hashing, keys, hits, the policy, the TTFT
model and the rejection filter, wired from the settings. It holds no I/O and no load: callers ask
the store, build the candidates and pass the time in.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Collection, Mapping, Sequence
from functools import partial

from kvgate.config.settings import InstanceConfig, Settings
from kvgate.scheduler.decode import DecodeChooser, PDDecision
from kvgate.scheduler.hashing import BlockExtras, BlockHash, extras_hashable, hash_blocks
from kvgate.scheduler.key_formats import make_key_format
from kvgate.scheduler.prefix import endpoint_map, prefix_hit_tokens
from kvgate.scheduler.prfaas import ClusterDecision, PrfaasRouter, cluster_view
from kvgate.scheduler.registry import make_policy
from kvgate.scheduler.rejection import Rejection, RejectionFilter
from kvgate.scheduler.tiers import EngineHits, TieredHits, local_hit_tokens, tiered_hits
from kvgate.scheduler.ttft import Predictions, TTFTModel, TTFTProfile
from kvgate.scheduler.types import Candidate, Decision, InstanceLoad, RoutingRequest, TTFTPrediction


class Scheduler:
    def __init__(
        self, settings: Settings, instances: Sequence[InstanceConfig], rng: random.Random | None = None
    ) -> None:
        self._settings = settings
        self._key_format = make_key_format(settings)
        self.policy = make_policy(settings, rng)
        self.endpoint_map = endpoint_map(self._settings, instances)
        self.ttft = TTFTModel(TTFTProfile.from_settings(settings), settings.ttft_calibration)
        self.rejection = RejectionFilter(settings.early_rejection, settings.ttft_slo_s, settings.tbt_slo_s)
        self._instance_ids = {instance.id for instance in instances}
        self._set_clusters(instances)
        self._decode = DecodeChooser()
        # Which cluster prefills each disaggregated request, when a PrfaaS cluster is configured.
        self.prfaas = PrfaasRouter(settings) if settings.prfaas_cluster else None

    def block_hashes(self, token_ids: Sequence[int], extras: BlockExtras | None = None) -> list[BlockHash]:
        s = self._settings
        return hash_blocks(
            s.kvs_hash_algo, token_ids, s.kvs_chunk_size, s.kvs_enable_save_unfull_chunk, s.hash_seed, extras
        )

    @property
    def extras_hashable(self) -> bool:
        """Whether block keys can mix in a LoRA adapter or a cache salt, as the engines' do."""
        return extras_hashable(self._settings.kvs_hash_algo)

    def block_keys(self, blocks: Sequence[BlockHash]) -> list[str]:
        return self._key_format.keys(blocks)

    def wants_kvs(self, num_prompt_tokens: int) -> bool:
        """Whether asking the store can change the decision (or the rejection filter's verdict,
        which reads the predicted TTFT, or the PrfaaS rule, which reads every cluster's prefix)."""
        return self.policy.uses_cache(num_prompt_tokens) or self.rejection.active or self.prfaas is not None

    def decide(
        self,
        num_prompt_tokens: int,
        blocks: Sequence[BlockHash],
        locations: Sequence[Collection[str]] | None,
        candidates: Sequence[Candidate],
        *,
        disk_locations: Sequence[Collection[str]] | None = None,
        engine: EngineHits | None = None,
        dry_run: bool = False,
    ) -> Decision:
        """Rank `candidates`. `locations` (memory replicas) None means the store did not answer: no
        store hits. `disk_locations` count only with --kvs-query-disk-tier. `engine`: what the
        engines' KV events say (None: no events). `dry_run` (the debug route) leaves the tie-break
        state alone."""
        local: dict[str, int] = {}
        pool: Callable[[], TieredHits] = TieredHits.empty
        if (locations is not None or engine is not None) and self.wants_kvs(num_prompt_tokens):
            local = self.local_hits(num_prompt_tokens, blocks, locations, engine)
            if locations is not None:
                disk = disk_locations if self._settings.kvs_query_disk_tier else None
                # The pool's view is built only if a prediction is read (conductor, rejection, debug).
                pool = partial(tiered_hits, blocks, locations, disk, self.endpoint_map, num_prompt_tokens, local,
                               engine)
            else:
                pool = partial(TieredHits, local, [], engine)
        predictions = Predictions(self.ttft, candidates, num_prompt_tokens, pool)
        request = RoutingRequest(num_prompt_tokens, local, predictions, dry_run)
        return self.policy.select(request, candidates)

    def store_hits(
        self, num_prompt_tokens: int, blocks: Sequence[BlockHash], locations: Sequence[Collection[str]] | None
    ) -> dict[str, int]:
        """The prefix each instance holds in its own store segment (the store's view alone)."""
        if locations is None:
            return {}
        return prefix_hit_tokens(blocks, locations, self.endpoint_map, num_prompt_tokens)

    def local_hits(
        self,
        num_prompt_tokens: int,
        blocks: Sequence[BlockHash],
        locations: Sequence[Collection[str]] | None,
        engine: EngineHits | None,
    ) -> dict[str, int]:
        """Each instance's local prefix, its store segment's or its engine's, the longer."""
        return local_hit_tokens(self.store_hits(num_prompt_tokens, blocks, locations), engine, num_prompt_tokens)

    def judge(
        self, decision: Decision, candidates: Sequence[Candidate], decode_load: InstanceLoad | None = None
    ) -> Rejection | None:
        """The rejection filter on a decision: None to admit, else why to answer 429.

        `decode_load` is the load of the instance that will decode; by default the selected one
        (a fleet of whole-request instances). A prefill/decode split passes its decode choice's.
        """
        if not self.rejection.active or decision.selected is None or decision.predictions is None:
            return None
        if decode_load is None:
            decode_load = next(c.load for c in candidates if c.id == decision.selected)
        return self.rejection.judge(decision.predictions[decision.selected], decode_load, self.ttft)

    def observe_dispatch(
        self, decision: Decision, instance_id: str, num_prompt_tokens: int, max_tokens: int | None
    ) -> TTFTPrediction | None:
        """A request was sent to `instance_id` (the traffic's running means learn from it). Returns
        the prediction to hand back to observe_ttft with the measured TTFT."""
        predictions = decision.predictions
        if predictions is None:
            return None
        try:  # one lookup: `in` on a Mapping computes the prediction, then [] fetches it again
            prediction = predictions[instance_id]
        except KeyError:
            return None
        self.ttft.observe_request(num_prompt_tokens, max_tokens)
        return prediction

    def observe_ttft(self, prediction: TTFTPrediction, measured_s: float) -> float:
        """First byte minus dispatch, for the prediction made at dispatch; returns the error
        (measured - predicted) and calibrates the instance."""
        return self.ttft.observe_ttft(prediction, measured_s)

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
        *,
        now: float,
        disk_locations: Sequence[Collection[str]] | None = None,
        engine: EngineHits | None = None,
        dry_run: bool = False,
    ) -> PDDecision:
        """Both halves of a disaggregated request: the configured policy over the prefill instances,
        decode load over the decode instances (scheduler/decode.py). With a PrfaaS cluster, the
        cluster rule (scheduler/prfaas.py) first narrows the prefill instances to one cluster;
        `now` is its clock, and `dry_run` (the debug route) leaves its state alone."""
        cluster = None
        if self.prfaas is not None and self._has_prfaas_cluster(decode_candidates):
            cluster, prefill_candidates = self._prefill_cluster(num_prompt_tokens, blocks, locations,
                                                                prefill_candidates, now, dry_run, engine)
        prefill = self.decide(num_prompt_tokens, blocks, locations, prefill_candidates,
                              disk_locations=disk_locations, engine=engine, dry_run=dry_run)
        decode = self._decode.choose(RoutingRequest(num_prompt_tokens, dry_run=dry_run), decode_candidates,
                                     predicted_decode_tokens)
        # The decode instance prefills a skipped request itself: what it misses is what it computes.
        decode_hit = 0
        if decode.selected is not None:
            decode_hit = self.local_hits(num_prompt_tokens, blocks, locations, engine).get(decode.selected, 0)
        miss = max(0, num_prompt_tokens - decode_hit)
        threshold = self._settings.pd_skip_prefill_below_tokens
        # An offloaded prompt is long by the rule's own measure: it is never computed by a decode instance.
        skip = bool(threshold) and miss <= threshold and not (cluster is not None and cluster.offloaded)
        return PDDecision(prefill, decode, skip_prefill=skip, decode_miss_tokens=miss, cluster=cluster)

    def _set_clusters(self, instances: Sequence[InstanceConfig]) -> None:
        self._cluster_of = {instance.id: instance.cluster for instance in instances}
        self._model_of = {instance.id: instance.model for instance in instances}
        # Models with an instance configured in the PrfaaS cluster: only these take the cluster rule.
        cluster = self._settings.prfaas_cluster
        self._prfaas_models = {instance.model for instance in instances if cluster and instance.cluster == cluster}

    def _has_prfaas_cluster(self, decode_candidates: Sequence[Candidate]) -> bool:
        # Every candidate serves the request's model; a decode instance is always local, so it names it.
        return any(self._model_of.get(c.id) in self._prfaas_models for c in decode_candidates[:1])

    def _prefill_cluster(
        self,
        num_prompt_tokens: int,
        blocks: Sequence[BlockHash],
        locations: Sequence[Collection[str]] | None,
        prefill_candidates: Sequence[Candidate],
        now: float,
        dry_run: bool,
        engine: EngineHits | None = None,
    ) -> tuple[ClusterDecision, Sequence[Candidate]]:
        assert self.prfaas is not None
        # Every instance's hit, whatever the policy: the rule's incremental length needs it.
        hits = self.local_hits(num_prompt_tokens, blocks, locations, engine)
        view = cluster_view(num_prompt_tokens, prefill_candidates, hits, self._cluster_of, self.prfaas.cluster)
        cluster = self.prfaas.decide(view.request, now, view.queues, prfaas_available=bool(view.prfaas),
                                     local_available=bool(view.local), dry_run=dry_run)
        return cluster, view.prfaas if cluster.offloaded else view.local

    def set_instances(self, instances: Sequence[InstanceConfig]) -> None:
        """Instances added or removed at run time: their store endpoints change with them."""
        self.endpoint_map = endpoint_map(self._settings, instances)
        ids = {instance.id for instance in instances}
        self._set_clusters(instances)
        self.ttft.forget(sorted(self._instance_ids - ids))
        self._instance_ids = ids
