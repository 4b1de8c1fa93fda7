"""The official openai client as the tests open it, and the list the close_openai_clients fixture
(conftest.py) empties after each test."""

from __future__ import annotations

import openai

# The openai clients openai_client opened; the close_openai_clients fixture (conftest.py) closes them after
# each test, so no client is left to the garbage collector once its event loop is gone.
opened_openai_clients: list[openai.AsyncOpenAI] = []


def openai_client(url: str, api_key: str = "unused", timeout: float = 30.0) -> openai.AsyncOpenAI:
    """The official client, without retries, for the OpenAI server at `url` (a module using it asks for the
    close_openai_clients fixture)."""
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
    opened_openai_clients.append(client)
    return client
