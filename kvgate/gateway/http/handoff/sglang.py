"""SGLang's hand-off (checked against sglang's router and disaggregation server, docs/PD.md).

The router adds three fields to the body and sends the same body to the prefill and the decode
server at once: `bootstrap_host` and `bootstrap_port` (the prefill server's bootstrap server,
`--disaggregation-bootstrap-port`, default 8998) and `bootstrap_room`, a random integer below 2**63
that both servers use to find each other. The client's answer is the decode server's.
"""

from __future__ import annotations

import secrets

from kvgate.config.pd import SGLANG_DEFAULT_BOOTSTRAP_PORT
from kvgate.config.settings import InstanceConfig
from kvgate.gateway.http.handoff.base import Body, HandOff, PairAttempt, bootstrap_host


class _Attempt(PairAttempt):
    def __init__(self, body: Body) -> None:
        self.prefill_body = body

    def decode_body(self, prefill_answer: Body | None) -> Body:
        return self.prefill_body


class SGLangHandOff(HandOff):
    name = "sglang"
    concurrent = True

    async def attempt(self, body: Body, prefill: InstanceConfig, request_id: str) -> PairAttempt:
        return _Attempt({
            **body,
            "bootstrap_host": bootstrap_host(prefill),
            "bootstrap_port": prefill.bootstrap_port or SGLANG_DEFAULT_BOOTSTRAP_PORT,
            "bootstrap_room": secrets.randbits(63),
        })

    def forget(self, prefill: InstanceConfig) -> None:
        pass  # every try draws a new room; nothing about the instance is remembered

    def local_body(self, body: Body) -> Body:
        # Refused at start-up (config/pd.py): an SGLang decode server needs a bootstrap room.
        raise NotImplementedError("skip-prefill is not available with pd_protocol sglang")
