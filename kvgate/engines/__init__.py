"""Real engines for tests, benchmarks and the demo: their virtualenv, a model, start and stop.

The gateway never imports this room: it talks to engines over HTTP and ZMQ only. Engines run in a
virtualenv of their own (`kvgate engines install vllm`), as separate processes pinned to one core each.
"""
