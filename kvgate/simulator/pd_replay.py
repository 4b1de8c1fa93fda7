"""The trace replay over a disaggregated fleet: P prefill and D decode instances.

Each arrival takes the gateway's PD decision (`Scheduler.decide_pd`: the configured policy over the
prefill instances, decode load over the decode instances, the skip-prefill rule). The prefill
instance computes the prompt and one token; the prompt's KV then travels to the decode instance
(`kv_transfer_tokens_per_s`), which finds it in its cache, computes the partial last block, and
generates. The client's first token is the decode instance's, so TTFT includes the transfer.
Accounting follows the gateway: prefill tokens on the prefill instance until its part is done,
one request and its predicted decode tokens on the decode instance until it finishes.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvgate.config.settings import InstanceRole, Settings
from kvgate.engine_model import EngineRequest, ServiceProfile, StepOutcome
from kvgate.scheduler.decode import DecodeLedger, PDDecision
from kvgate.scheduler.types import Candidate
from kvgate.simulator.replay import (
    _STEP_START,
    Replay,
    SimInstance,
    SimulationResult,
    hit_ratio_reference,
)
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest

# Prompt tokens per second moved from a prefill to a decode GPU: ~100 Gbit/s of RDMA at the
# simulated model's 128 KiB of KV per token (simulator/profile.py).
DEFAULT_KV_TRANSFER_TOKENS_PER_S = 100_000.0
_TRANSFER_DONE = 4  # after the base replay's event kinds


class PDReplay(Replay):
    def __init__(
        self,
        requests: Sequence[TraceRequest],
        settings: Settings,
        num_prefill: int,
        num_decode: int,
        profile: ServiceProfile,
        *,
        kv_transfer_tokens_per_s: float = DEFAULT_KV_TRANSFER_TOKENS_PER_S,
        seed: int = 0,
        show_progress: bool = False,
        reference=None,
        store_model: str = "shared",
    ) -> None:
        if num_prefill < 1 or num_decode < 1:
            raise ValueError("a disaggregated fleet needs at least one prefill and one decode instance")
        if kv_transfer_tokens_per_s <= 0:
            raise ValueError("the KV transfer rate must be positive")
        total = num_prefill + num_decode
        super().__init__(
            requests, settings, total, profile, seed=seed, show_progress=show_progress,
            reference=reference or hit_ratio_reference(requests, total * profile.cache_capacity_blocks),
            store_model=store_model,
        )
        for slot, inst in enumerate(self.instances):
            role = InstanceRole.PREFILL if slot < num_prefill else InstanceRole.DECODE
            inst.config = inst.config.model_copy(update={"role": role})
        if self.index is None:
            raise ValueError("--kvs-backend kv_events replays neutral instances only (not PD or PrfaaS yet)")
        self.scheduler.set_instances([inst.config for inst in self.instances])
        self._transfer_rate = kv_transfer_tokens_per_s
        self.ledger = DecodeLedger()
        self._decode_slot: dict[int, int] = {}
        self._keys: dict[int, tuple[str, ...]] = {}
        self._transfers = 0

    def _candidates(self, role: InstanceRole) -> list[Candidate]:
        return [Candidate(inst.config.id, role, self.account.load(inst.config.id))
                for inst in self.instances if inst.config.role == role]

    def _dispatch(self, req: TraceRequest, now: float) -> None:
        scheduler = self.scheduler
        n = req.input_length
        blocks = self.blocks(req)
        keys = scheduler.block_keys(blocks)
        wants_hits = scheduler.wants_kvs(n) or self._settings.pd_skip_prefill_below_tokens > 0
        locations = [self.index.holders(key) for key in keys] if wants_hits else None
        pd = scheduler.decide_pd(n, blocks, locations, self._candidates(InstanceRole.PREFILL),
                                 self._candidates(InstanceRole.DECODE), self.ledger.tokens, now=now)
        self._decided(pd, now)
        rid, i = str(req.index), req.index
        full_keys = tuple(keys[: n // TRACE_BLOCK_TOKENS])
        decode_id = pd.decode.ranking[0]
        self._decode_slot[i] = self._slot_of[decode_id]
        self._keys[i] = full_keys
        output = max(1, req.output_length)
        self.ledger.add(rid, decode_id, output)
        if pd.skip_prefill:
            self.account.dispatch(rid + "/d", decode_id, pd.decode_miss_tokens, now)
            self._submit(self._decode_slot[i], EngineRequest(rid, full_keys, n, output), now)
            return
        prefill = pd.prefill.scores[0]
        self.account.dispatch(rid + "/p", prefill.id, prefill.prefix_miss_tokens, now)
        self.account.dispatch(rid + "/d", decode_id, 0, now)
        self._submit(self._slot_of[prefill.id], EngineRequest(rid, full_keys, n, 1), now)

    def _decided(self, pd: PDDecision, now: float) -> None:
        """A request's PD decision, before dispatch (the PrfaaS replay puts shipped prefixes on its link)."""

    def _kv_arrives_at(self, prefill: SimInstance, i: int, now: float) -> float:
        """When request i's KV, prefilled on `prefill` and done at `now`, reaches its decode instance."""
        return now + self._requests[i].input_length / self._transfer_rate

    def _submit(self, slot: int, request: EngineRequest, now: float) -> None:
        inst = self.instances[slot]
        inst.requests += 1
        inst.engine.submit(request, now)
        if not inst.busy:
            inst.busy = True
            self._push(now, _STEP_START, slot)

    def _record(self, inst: SimInstance, out: StepOutcome, now: float) -> None:
        if inst.config.role == InstanceRole.PREFILL:
            for rid in out.finished:  # one token: the prefill's part is done, the KV leaves
                self.account.release(rid + "/p")
                i = int(rid)
                self._transfers += 1
                self._push(self._kv_arrives_at(inst, i, now), _TRANSFER_DONE, i)
            return
        requests = self._requests
        for rid in out.first_tokens:
            i = int(rid)
            self.ttft[i] = now - requests[i].arrival_s
            self.account.first_token(rid + "/d", now)
        for rid in out.finished:
            i = int(rid)
            self.finish[i] = now
            self.tbt[i] = (now - requests[i].arrival_s - self.ttft[i]) / max(1, requests[i].output_length - 1)
            self.account.release(rid + "/d")
            self.ledger.release(rid)

    def _on_event(self, kind: int, slot: int, now: float) -> None:
        """A prompt's KV reached its decode instance: cached there, then decoded."""
        assert kind == _TRANSFER_DONE
        i = slot
        self._transfers -= 1
        req = self._requests[i]
        decode = self._decode_slot.pop(i)
        keys = self._keys.pop(i)
        self.instances[decode].engine.cache.insert(keys)
        self._submit(decode, EngineRequest(str(i), keys, req.input_length, max(1, req.output_length)), now)

    def _has_work(self) -> bool:
        return self._transfers > 0 or super()._has_work()

    def _prompt_instances(self) -> list[SimInstance]:
        # Decode instances find every transferred prompt in their cache: counting them would
        # report transfers as hits.
        return [inst for inst in self.instances if inst.config.role == InstanceRole.PREFILL]


def simulate_pd(
    requests: Sequence[TraceRequest],
    settings: Settings,
    num_prefill: int,
    num_decode: int,
    profile: ServiceProfile,
    *,
    kv_transfer_tokens_per_s: float = DEFAULT_KV_TRANSFER_TOKENS_PER_S,
    seed: int = 0,
    show_progress: bool = False,
    store_model: str = "shared",
) -> SimulationResult:
    return PDReplay(requests, settings, num_prefill, num_decode, profile,
                    kv_transfer_tokens_per_s=kv_transfer_tokens_per_s, seed=seed,
                    show_progress=show_progress, store_model=store_model).run()
