"""kvgate: a KV-cache-aware gateway and scheduler for fleets of LLM inference engines."""

__version__ = "0.1.0"
