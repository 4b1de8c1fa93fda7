"""The one interface every prefill/decode hand-off implements (docs/PD.md).

A hand-off turns the client's body into what the prefill and the decode instance must receive so
that the KV computed by one reaches the other. Engines change these fields between releases, so
each protocol lives in a module of its own and nothing outside this package knows a field name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any
from urllib.parse import urlsplit

from kvgate.config.settings import InstanceConfig

Body = dict[str, Any]


class HandOffError(Exception):
    """The prefill instance's answer cannot start a decode (e.g. no transfer parameters)."""


class PairAttempt(ABC):
    """One try of one (prefill, decode) pair: fresh identifiers each time, so a retry never
    meets the KV or the room of a failed try."""

    prefill_body: Body

    @abstractmethod
    def decode_body(self, prefill_answer: Body | None) -> Body:
        """The decode instance's body; `prefill_answer` is the prefill's JSON answer when the
        protocol waits for it (None when both are sent at once). Raises HandOffError."""


class HandOff(ABC):
    name: str
    # True: prefill and decode bodies go out at the same time and the engines meet on their own.
    # False: the decode body is built from the prefill instance's answer.
    concurrent: bool

    @abstractmethod
    async def attempt(self, body: Body, prefill: InstanceConfig, request_id: str) -> PairAttempt:
        """A new try with `prefill`; may ask the prefill's bootstrap server what the hand-off needs
        (raises HandOffError when it cannot)."""

    @abstractmethod
    def forget(self, prefill: InstanceConfig) -> None:
        """A try with `prefill` failed: drop what was remembered about it (e.g. an engine id)."""

    @abstractmethod
    def local_body(self, body: Body) -> Body:
        """The decode instance's body when it prefills the prompt itself (skip-prefill)."""


def bootstrap_host(instance: InstanceConfig) -> str:
    return instance.bootstrap_host or urlsplit(instance.url).hostname or ""
