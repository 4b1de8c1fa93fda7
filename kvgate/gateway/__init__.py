"""The OpenAI-compatible gateway (`kvgate serve`). A request's path through the modules:

observe.py (request id, counts) -> errors.py (OpenAI-style errors, one place) -> app.py (routes)
-> protocol.py (validate the body) -> routing.py (tokenizer.py, hash, KV store, scheduler decision)
-> the scheduler's rejection filter (429 + Retry-After) -> forwarder.py (retries, SSE relay; inflight.py keeps the account, ttft_feedback.py calibrates)
-> upstream.py (pooled keep-alive connections to the engines).
Beside it: registry.py + health.py (instances and their health), engine_stats.py (engine load
scraping), admin.py, debug.py, server.py (start_gateway for programs, run_gateway for the CLI).
"""
