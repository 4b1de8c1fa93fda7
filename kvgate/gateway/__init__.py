"""The gateway: one core, two front doors over it (ARCHITECTURE.md).

The core (core.py builds it once, state.py holds it): fleet/ (instances, health, engine stats, the
account's shared rows, run-time changes), planning/ (prompt -> token ids -> block keys -> store and
KV-events lookups -> the scheduler's decision; core.plan_admitted adds early rejection) and
feedback/ (first byte, usage and end of each answer back into the account, the TTFT model and the
hit accounting). errors.py and protocol.py are shared: OpenAI errors and request bodies.

The front doors: http/ (kvgate is the proxy: the aiohttp app, forwarding, SSE relay, PD hand-offs)
and ext_proc/ (Envoy is the proxy, kvgate its endpoint picker). Both serve operations/ (/health,
/livez, /metrics, /debug, /admin) and may trace a request (tracing/).
"""
