"""A simulated vLLM instance: OpenAI API over an EngineCore stepped in real time (see server.py)."""

from kvgate.mock_engine.server import DEFAULT_MODEL, MockEngineConfig, MockEngineHandle, start_mock_engine

__all__ = ["DEFAULT_MODEL", "MockEngineConfig", "MockEngineHandle", "start_mock_engine"]
