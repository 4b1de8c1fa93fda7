"""Tracing through the endpoint picker behind a real Envoy: the picker continues the client's traceparent,
traces the planner's stages and the pick, and has Envoy send the engine the pick's own traceparent (a
header mutation), so the engine's spans join the trace; refusals are spans too."""

from __future__ import annotations

import aiohttp
import pytest

pytest.importorskip("grpc", reason="the endpoint picker needs its extra: pip install 'kvgate[epp]'")
pytest.importorskip("opentelemetry.sdk", reason="tracing needs its extra: pip install 'kvgate[tracing]'")

from kvgate.gateway.ext_proc.server import start_picker  # noqa: E402 (after the skips)
from kvgate.gateway.tracing import names
from tests.envoy_proxy import envoy_binary, running_envoy
from tests.gateway_helpers import gateway_settings, tokenizer, wait_until
from tests.otlp_receiver import running_receiver
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(autouse=True)
def _envoy_installed() -> None:
    envoy_binary()


async def test_the_pick_is_traced_and_the_engine_gets_its_traceparent_through_envoy(tmp_path):
    upstream = await ScriptedUpstream("a", Script()).start()
    try:
        async with running_receiver() as receiver:
            settings = gateway_settings({"a": upstream.url}, MODEL, epp_http_port=0,
                                        otlp_traces_endpoint=receiver.http_endpoint)
            picker = await start_picker(settings, tokenizer=tokenizer())
            try:
                async with running_envoy(picker.grpc_address, tmp_path) as envoy, aiohttp.ClientSession() as session:
                    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 3, "stream": True}
                    async with session.post(envoy.url + "/v1/completions", json=body, headers={
                            "traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}) as answer:
                        assert answer.status == 200 and (await answer.read()).endswith(b"data: [DONE]\n\n")
                    async with session.post(envoy.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) \
                            as refused:
                        assert refused.status == 404
                    await wait_until(lambda: picker.gateway.account.total_inflight() == 0)
                [server] = await receiver.wait_for(lambda s: s.kind == "server" and s.trace_id == CLIENT_TRACE)
                assert server.parent_span_id == CLIENT_SPAN and server.name == "POST /v1/completions"
                assert server.attributes[names.FRONT_DOOR] == "epp"
                assert server.attributes[names.HTTP_STATUS] == 200 and server.attributes[names.INSTANCE] == "a"
                assert server.attributes[names.STREAM] is True
                spans = {span.name: span for span in await receiver.wait_for(
                    lambda s: s.parent_span_id == server.span_id, 4)}
                assert set(spans) == {names.TOKENIZE, names.LOOKUP, names.SCHEDULE, names.FORWARD}
                forward = spans[names.FORWARD]
                assert forward.kind == "client" and forward.events == (names.FIRST_BYTE,)
                assert forward.attributes[names.HTTP_STATUS] == 200 and forward.end_ns <= server.end_ns
                # Envoy sent the engine the picker's traceparent, not the client's.
                [seen] = upstream.seen
                assert seen.headers["traceparent"] == forward.traceparent
                [unknown] = await receiver.wait_for(lambda s: s.kind == "server" and s.trace_id != CLIENT_TRACE)
                assert unknown.attributes[names.HTTP_STATUS] == 404
                assert unknown.attributes[names.ERROR_CODE] == "model_not_found"
                assert receiver.children(unknown) == []
            finally:
                await picker.close()
    finally:
        await upstream.close()
