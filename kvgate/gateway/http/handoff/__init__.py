"""Prefill/decode hand-offs, one module per protocol, chosen by `pd_protocol`."""

from __future__ import annotations

from kvgate.config.settings import PDProtocol
from kvgate.gateway.http.handoff.base import HandOff, HandOffError, PairAttempt
from kvgate.gateway.http.handoff.sglang import SGLangHandOff
from kvgate.gateway.http.handoff.vllm import VLLMHandOff

HANDOFFS: dict[PDProtocol, type[HandOff]] = {PDProtocol.SGLANG: SGLangHandOff, PDProtocol.VLLM: VLLMHandOff}


def make_handoff(protocol: PDProtocol) -> HandOff:
    return HANDOFFS[protocol]()


__all__ = ["HANDOFFS", "HandOff", "HandOffError", "PairAttempt", "make_handoff"]
