"""`kvgate bench routers`: kvgate side by side with sglang-router and vllm-router, in one run.

Every target (a router with a policy, or no router at all) gets the same two phases:

1. Workload replay. Fresh mock engines (separate `kvgate mock-engine` processes, cold caches,
   publishing their blocks to a Redis index that only kvgate reads) with the router in front; a
   Mooncake trace replayed through it, time-compressed. Prompts are sent as text, because
   sglang-router refuses token-id prompts (HTTP 422); each trace token is one word that the
   engines' tokenizer encodes as one token. Figures: token-weighted hit ratio and TTFT.
2. Overhead. The router in front of instant backends (answers at once, see instant_backend);
   closed loops at concurrency 1 and 32 with a ~2 KB non-streaming one-token request (~400
   tokens: kvgate's cache-aware threshold is lowered below it, so kvgate tokenizes, hashes and
   asks the store as for a long prompt). The same loops sent straight to one backend are the
   baseline: added latency = router - direct. `--workers 1,2` runs kvgate once per worker count.

The load generator always runs in a process of its own. Routers and engines are processes too,
all on 127.0.0.1. Peers are installed into their own virtualenv (see peers.py); one that cannot
be installed or started is reported as unavailable with the reason.

The package is split by job: `targets` (what is compared and what each yields), `processes`
(engines, backends and routers as child processes), `phases` (replay and overhead, target by
target), `report` (table, JSON, plot) and `command` (the flags).
"""

from kvgate.bench.routers.command import add_parser

__all__ = ["add_parser"]
