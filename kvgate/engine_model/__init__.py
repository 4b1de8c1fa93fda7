"""Pure model of an inference engine's service: batching, chunked prefill, prefix cache, timing.

No I/O and no clock of its own: the mock engine drives it in real time, the simulator in virtual time.
"""

from kvgate.engine_model.cache import BlockCache
from kvgate.engine_model.core import CoreStats, EngineCore, EngineRequest, StepOutcome
from kvgate.engine_model.profile import DecodeCost, QuadraticPrefillCost, ServiceProfile, TablePrefillCost

__all__ = [
    "BlockCache",
    "DecodeCost",
    "EngineCore",
    "EngineRequest",
    "CoreStats",
    "QuadraticPrefillCost",
    "ServiceProfile",
    "StepOutcome",
    "TablePrefillCost",
]
