"""The greedy oracle: how well a dispatch-time choice could do with perfect knowledge.

Each request goes to the instance where a forward run of that engine's exact state (queue, running
batch, HBM contents, the store's segments) gives the earliest first token, later arrivals unknown.
No gateway can know that much (it sees neither HBM nor the engines' batches), so this bounds what
any TTFT-predicting policy such as conductor can gain by placement alone. `kvgate simulate
--oracle` adds it as a row; docs/SCHEDULING.md reads it against conductor and cache_aware.
"""

from __future__ import annotations

from kvgate.engine_model import EngineRequest
from kvgate.engine_model.store import StoreLoad
from kvgate.simulator.replay import _STEP_START, Replay
from kvgate.simulator.trace import TRACE_BLOCK_TOKENS, TraceRequest

ORACLE_NAME = "greedy_oracle"


class OracleReplay(Replay):
    """A Replay whose dispatch is the oracle's (the account is kept as usual; no rejection)."""

    @property
    def policy_name(self) -> str:
        return ORACLE_NAME

    def _dispatch(self, req: TraceRequest, now: float) -> None:
        n = req.input_length
        keys = self.scheduler.block_keys(self.blocks(req))
        rid = str(req.index)
        engine_request = EngineRequest(rid, tuple(keys[: n // TRACE_BLOCK_TOKENS]), n, max(1, req.output_length))
        slot = min(range(len(self.instances)), key=lambda s: (self._forecast(s, engine_request, now), s))
        inst = self.instances[slot]
        self.account.dispatch(rid, inst.config.id, n, now)
        inst.requests += 1
        inst.engine.submit(engine_request, now)
        if not inst.busy:
            inst.busy = True
            self._push(now, _STEP_START, slot)

    def _forecast(self, slot: int, req: EngineRequest, now: float) -> float:
        inst = self.instances[slot]
        free_at = inst.pending_ends_at if inst.pending is not None else now
        store = self.store
        loader = None
        if store is not None:

            def loader(keys: tuple[str, ...]) -> StoreLoad:
                return store.plan_load(slot, keys, touch=False)

        return inst.engine.forecast_ttft(req, now, free_at, loader)
