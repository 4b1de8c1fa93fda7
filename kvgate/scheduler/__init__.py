"""The pure scheduling core: token hashing, store keys, prefix hits, metrics, policies, load account.

No I/O, no globals, no wall clock (callers pass `now`): the gateway and the trace simulator run
this same code. `Scheduler` (router.py) wires it from the settings; `LoadAccount` keeps the load.
"""

from kvgate.scheduler.account import LoadAccount
from kvgate.scheduler.router import Scheduler
from kvgate.scheduler.types import (
    Candidate,
    Decision,
    EngineStats,
    InstanceLoad,
    InstanceScore,
    RoutingRequest,
)

__all__ = [
    "Candidate",
    "Decision",
    "EngineStats",
    "InstanceLoad",
    "InstanceScore",
    "LoadAccount",
    "RoutingRequest",
    "Scheduler",
]
