"""OpenTelemetry tracing through the HTTP front door, exported to a real OTLP receiver on loopback
(tests/otlp_receiver.py): one server span per request with the planner's stages and each attempt as
children, their documented attributes, the W3C traceparent continued from the client and handed to
the engines, early rejection, retries, prefill/decode pairs, gRPC export, sampling and shutdown."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
import pytest

pytest.importorskip("opentelemetry.sdk", reason="tracing needs its extra: pip install 'kvgate[tracing]'")

from kvgate.config.loader import load_settings  # noqa: E402 (after the skip)
from kvgate.config.settings import Settings
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.gateway.tracing import names
from tests.gateway.test_pd import engine as pd_engine
from tests.gateway.test_pd import free_port
from tests.gateway.test_pd import instance as pd_instance
from tests.gateway.test_pd import settings as pd_settings
from tests.gateway_helpers import (
    EmbeddedFleet,
    assert_nothing_in_flight,
    gateway_settings,
    scripted_upstreams,
    tokenizer,
)
from tests.openai_helpers import openai_client
from tests.otlp_receiver import OTLPReceiver, ReceivedSpan, running_receiver
from tests.scripted_upstream import MODEL

pytestmark = pytest.mark.usefixtures("close_openai_clients")

MOCK_MODEL = "kvgate/mock-llm"
CHUNK = 16
PROMPT = list(range(1000, 1200))  # 12 full blocks: a repeat finds 192 tokens cached
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
STAGES = [names.TOKENIZE, names.LOOKUP, names.SCHEDULE]


def client(url: str) -> openai.AsyncOpenAI:
    return openai_client(url)


async def post(url: str, body: dict, headers: dict | None = None) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as session, session.post(url + "/v1/completions", json=body,
                                                                headers=headers or {}) as response:
        return response.status, await response.json()


async def server_spans(receiver: OTLPReceiver, count: int) -> list[ReceivedSpan]:
    return await receiver.wait_for(lambda s: s.kind == "server" and s.service == "kvgate", count)


async def children(receiver: OTLPReceiver, parent: ReceivedSpan, count: int) -> dict[str, list[ReceivedSpan]]:
    """The parent's children by name, once `count` arrived (spans of one request may come in two batches)."""
    found = await receiver.wait_for(lambda s: s.trace_id == parent.trace_id and s.parent_span_id == parent.span_id,
                                    count)
    by_name: dict[str, list[ReceivedSpan]] = {}
    for span in sorted(found, key=lambda s: s.start_ns):
        by_name.setdefault(span.name, []).append(span)
    return by_name


def traced(settings: Settings, receiver: OTLPReceiver, **overrides) -> Settings:
    return settings.model_copy(update={"otlp_traces_endpoint": receiver.http_endpoint, **overrides})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_routed_completion_is_one_trace_of_the_planner_stages_and_the_forward(stream):
    settings = Settings(port=0, kvs_chunk_size=CHUNK, dispatch_policy="cache_aware",
                        cache_aware_scheduling_min_tokens=0, health_check_interval_s=60.0, stats_poll_interval_s=60.0)
    async with running_receiver() as receiver, EmbeddedFleet(traced(settings, receiver),
                                                              {"e0": Settings(kvs_chunk_size=CHUNK),
                                                               "e1": Settings(kvs_chunk_size=CHUNK)}) as fleet:
        api = client(fleet.gateway.url)
        await api.completions.create(model=MOCK_MODEL, prompt=PROMPT, max_tokens=2)
        await fleet.flushed()  # the engine's blocks are in the store: the repeat is a predicted hit
        if stream:
            answer = await api.completions.create(model=MOCK_MODEL, prompt=PROMPT, max_tokens=5, stream=True)
            assert len([chunk async for chunk in answer]) >= 5
        else:
            await api.completions.create(model=MOCK_MODEL, prompt=PROMPT, max_tokens=5)
        first, second = sorted(await server_spans(receiver, 2), key=lambda s: s.start_ns)
        assert first.trace_id != second.trace_id and first.parent_span_id == ""  # each request its own trace
        attributes = second.attributes
        holder = attributes[names.INSTANCE]
        assert second.name == "POST /v1/completions" and second.status == "unset"
        assert {key: attributes[key] for key in (
            names.HTTP_METHOD, names.HTTP_ROUTE, names.HTTP_STATUS, names.GEN_AI_OPERATION, names.GEN_AI_MODEL,
            names.GEN_AI_MAX_TOKENS, names.STREAM, names.FRONT_DOOR, names.POLICY, names.CANDIDATES,
            names.PROMPT_TOKENS, names.PREFIX_HIT_TOKENS, names.KVS_STATUS, names.EVENTS_STATUS)} == {
            names.HTTP_METHOD: "POST", names.HTTP_ROUTE: "/v1/completions", names.HTTP_STATUS: 200,
            names.GEN_AI_OPERATION: "text_completion", names.GEN_AI_MODEL: MOCK_MODEL, names.GEN_AI_MAX_TOKENS: 5,
            names.STREAM: stream, names.FRONT_DOOR: "http", names.POLICY: "cache_aware", names.CANDIDATES: 2,
            names.PROMPT_TOKENS: 200, names.PREFIX_HIT_TOKENS: 192, names.KVS_STATUS: "ok",
            names.EVENTS_STATUS: "off"}
        assert first.attributes[names.PREFIX_HIT_TOKENS] == 0  # a cold store predicted nothing
        assert attributes[names.RANKING][0] == holder and sorted(attributes[names.RANKING]) == ["e0", "e1"]
        terms = attributes[names.TTFT_QUEUE] + attributes[names.TTFT_PREFILL] + attributes[names.TTFT_TRANSFER]
        assert attributes[names.TTFT_PREDICTED] == pytest.approx(terms) and attributes[names.TTFT_PREDICTED] > 0
        assert len(attributes[names.REQUEST_ID]) == 32

        spans = await children(receiver, second, 4)
        assert list(spans) == [*STAGES, names.FORWARD]
        tokenize, lookup, schedule, forward = (spans[name][0] for name in [*STAGES, names.FORWARD])
        assert tokenize.attributes[names.PROMPT_TOKENS] == 200
        assert lookup.attributes[names.KVS_STATUS] == "ok" and lookup.attributes[names.BLOCKS] == 12
        assert schedule.attributes[names.INSTANCE] == holder
        # The stages follow one another inside the request's span; the forward ends with the answer.
        assert second.start_ns <= tokenize.start_ns <= tokenize.end_ns <= lookup.start_ns <= lookup.end_ns
        assert lookup.end_ns <= schedule.start_ns <= schedule.end_ns <= forward.start_ns
        assert forward.end_ns <= second.end_ns
        assert forward.kind == "client" and forward.events == (names.FIRST_BYTE,)
        port = int(fleet.engines[holder].url.rsplit(":", 1)[1])
        assert {key: forward.attributes[key] for key in (names.INSTANCE, names.ATTEMPT, names.SERVER_PORT,
                                                         names.HTTP_STATUS)} == {
            names.INSTANCE: holder, names.ATTEMPT: 1, names.SERVER_PORT: port, names.HTTP_STATUS: 200}


@pytest.fixture
async def upstreams():
    async with scripted_upstreams("a", "b") as started:
        yield list(started.values())


async def test_the_clients_traceparent_is_continued_and_each_engine_gets_its_attempts(upstreams):
    a, b = upstreams
    a.script.status = 503  # tried first (least load, ties by order), fails, then b answers
    async with running_receiver() as receiver:
        handle = await start_gateway(traced(gateway_settings({"a": a.url, "b": b.url}, MODEL), receiver),
                                     tokenizer=tokenizer())
        try:
            status, _ = await post(handle.url, {"model": MODEL, "prompt": "hello", "max_tokens": 3},
                                   {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
            assert status == 200
            [server] = await server_spans(receiver, 1)
            assert (server.trace_id, server.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
            spans = await children(receiver, server, 5)
            failed, answered = spans[names.FORWARD]
            assert (failed.attributes[names.INSTANCE], failed.attributes[names.ATTEMPT], failed.status) == ("a", 1,
                                                                                                            "error")
            assert (answered.attributes[names.INSTANCE], answered.attributes[names.ATTEMPT]) == ("b", 2)
            assert answered.status == "unset" and answered.events == (names.FIRST_BYTE,)
            # Each engine was asked under its own attempt's span: its spans join the client's trace.
            assert a.seen[0].headers["traceparent"] == failed.traceparent
            assert b.seen[0].headers["traceparent"] == answered.traceparent
            await assert_nothing_in_flight(handle)
        finally:
            await handle.close()


async def test_an_early_rejection_is_a_429_span_with_its_code_and_prediction(upstreams):
    a, _ = upstreams
    async with running_receiver() as receiver:
        settings = gateway_settings({"a": a.url}, MODEL, ttft_slo_s=0.1, ttft_prefill_points=((1000, 1.0),),
                                    ttft_calibration=False)
        handle = await start_gateway(traced(settings, receiver), tokenizer=tokenizer())
        try:
            status, payload = await post(handle.url, {"model": MODEL, "prompt": "word " * 300})
            assert status == 429 and payload["error"]["code"] == "ttft_slo_exceeded"
            [server] = await server_spans(receiver, 1)
            assert server.attributes[names.HTTP_STATUS] == 429 and server.status == "unset"  # the client's error
            assert server.attributes[names.REJECTION_CODE] == "ttft_slo_exceeded"
            assert server.attributes[names.ERROR_CODE] == "ttft_slo_exceeded"
            assert server.attributes[names.INSTANCE] == "a" and server.attributes[names.TTFT_PREDICTED] > 0.1
            assert list(await children(receiver, server, 3)) == STAGES  # planned, never forwarded
            assert a.seen == []
        finally:
            await handle.close()
        assert names.FORWARD not in {span.name for span in receiver.spans}


async def test_refusals_before_planning_and_engine_failures_are_spans_too(upstreams):
    a, _ = upstreams
    a.script.status = 500
    async with running_receiver() as receiver:
        handle = await start_gateway(traced(gateway_settings({"a": a.url}, MODEL, forward_retries=0), receiver),
                                     tokenizer=tokenizer())
        try:
            assert (await post(handle.url, {"model": "nope", "prompt": "x"}))[0] == 404
            assert (await post(handle.url, {"model": MODEL, "prompt": "x"}))[0] == 502
            unknown, failed = sorted(await server_spans(receiver, 2), key=lambda s: s.start_ns)
            assert unknown.attributes[names.HTTP_STATUS] == 404
            assert unknown.attributes[names.ERROR_CODE] == "model_not_found" and unknown.status == "unset"
            assert failed.attributes[names.HTTP_STATUS] == 502 and failed.status == "error"
            assert failed.attributes[names.ERROR_TYPE]  # 5xx: the error's type is named
            [forward] = (await children(receiver, failed, 4))[names.FORWARD]
            assert forward.status == "error" and forward.attributes[names.INSTANCE] == "a"
        finally:
            await handle.close()


@pytest.mark.parametrize("protocol", ["sglang", "vllm"])
async def test_a_disaggregated_request_traces_its_prefill_and_decode(protocol):
    bootstrap = free_port() if protocol == "sglang" else None
    prefill, decode = await pd_engine("prefill", protocol, bootstrap), await pd_engine("decode", protocol)
    try:
        async with running_receiver() as receiver:
            settings = pd_settings(protocol, [pd_instance("p0", prefill.url, "prefill", bootstrap),
                                              pd_instance("d0", decode.url, "decode")])
            handle = await start_gateway(traced(settings, receiver), tokenizer=tokenizer())
            try:
                stream = await client(handle.url).completions.create(model=MOCK_MODEL, prompt="Once upon a time " * 80,
                                                                     max_tokens=4, stream=True)
                assert len([chunk async for chunk in stream]) >= 4
                [server] = await server_spans(receiver, 1)
                assert server.attributes[names.INSTANCE] == "p0"
                assert server.attributes[names.PD_DECODE_INSTANCE] == "d0"
                assert server.attributes[names.PD_SKIP_PREFILL] is False
                spans = await children(receiver, server, 5)
                assert set(spans) == {*STAGES, names.PREFILL, names.DECODE}
                [prefilled], [decoded] = spans[names.PREFILL], spans[names.DECODE]
                assert prefilled.kind == decoded.kind == "client"
                assert (prefilled.attributes[names.INSTANCE], decoded.attributes[names.INSTANCE]) == ("p0", "d0")
                assert prefilled.attributes[names.HTTP_STATUS] == 200 and names.FIRST_BYTE in prefilled.events
                assert decoded.attributes[names.HTTP_STATUS] == 200 and decoded.events == (names.FIRST_BYTE,)
                await assert_nothing_in_flight(handle)
            finally:
                await handle.close()
    finally:
        for engine in (prefill, decode):
            await engine.close()


async def test_grpc_export_and_a_clean_shutdown_flushes_what_is_queued(upstreams):
    a, _ = upstreams
    async with running_receiver() as receiver:
        settings = gateway_settings({"a": a.url}, MODEL, otlp_traces_endpoint=receiver.grpc_endpoint,
                                    otlp_traces_protocol="grpc", otlp_service_name="gateway-east")
        handle = await start_gateway(settings, tokenizer=tokenizer())
        try:
            assert (await post(handle.url, {"model": MODEL, "prompt": "hello"}))[0] == 200
        finally:
            await handle.close()  # before the exporter's next round (a second): close() must flush
        [server] = [s for s in receiver.spans if s.kind == "server"]
        assert server.service == "gateway-east" and server.transport == "grpc"
        assert {s.name for s in receiver.children(server)} == {*STAGES, names.FORWARD}


async def test_unsampled_requests_export_nothing_but_engines_still_get_the_context(upstreams):
    a, _ = upstreams
    async with running_receiver() as receiver:
        settings = traced(gateway_settings({"a": a.url}, MODEL), receiver, otlp_traces_sample_ratio=0.0)
        handle = await start_gateway(settings, tokenizer=tokenizer())
        try:
            assert (await post(handle.url, {"model": MODEL, "prompt": "hello"}))[0] == 200
            # A sampled parent is followed whatever the ratio.
            assert (await post(handle.url, {"model": MODEL, "prompt": "hello"},
                               {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}))[0] == 200
            await handle.app[GATEWAY].tracing.flush()
        finally:
            await handle.close()
        assert {s.trace_id for s in receiver.spans} == {CLIENT_TRACE}
        unsampled, sampled = (seen.headers["traceparent"].split("-") for seen in a.seen)
        assert unsampled[1] != CLIENT_TRACE and int(unsampled[3], 16) & 1 == 0  # the sampled flag is off
        assert sampled[1] == CLIENT_TRACE and int(sampled[3], 16) & 1 == 1


async def test_off_by_default_and_nothing_reaches_the_engines(upstreams):
    a, _ = upstreams
    handle = await start_gateway(gateway_settings({"a": a.url}, MODEL), tokenizer=tokenizer())
    try:
        assert handle.app[GATEWAY].tracing is None
        status, _ = await post(handle.url, {"model": MODEL, "prompt": "hello"},
                               {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})
        assert status == 200 and "traceparent" not in a.seen[0].headers
    finally:
        await handle.close()


def test_the_protocol_and_service_name_follow_opentelemetrys_variables_below_kvgates():
    otel = {"OTEL_EXPORTER_OTLP_PROTOCOL": "grpc", "OTEL_SERVICE_NAME": "edge"}
    assert load_settings(environ=otel).otlp_traces_protocol == "grpc"
    assert load_settings(environ=otel).otlp_service_name == "edge"
    # The traces-specific variable wins over the general one, KVGATE_* over both, a flag over all.
    specific = {**otel, "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf"}
    assert load_settings(environ=specific).otlp_traces_protocol == "http/protobuf"
    assert load_settings(environ={**specific, "KVGATE_OTLP_TRACES_PROTOCOL": "grpc"}).otlp_traces_protocol == "grpc"
    assert load_settings({"otlp_service_name": "flag"}, environ=otel).otlp_service_name == "flag"
    assert load_settings(environ={}).otlp_traces_endpoint == ""  # off by default
    with pytest.raises(ValueError, match="otlp-traces-protocol"):
        load_settings(environ={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/json"})


async def test_bench_overhead_measures_a_traced_gateway_beside_the_untraced_one(tmp_path):
    from kvgate.bench.overhead import OverheadConfig, gateway_label, measure

    async with running_receiver(grpc_too=False) as receiver:
        config = OverheadConfig(concurrency=(2,), duration_s=0.3, max_requests=40, runs=1, workers=(1,), peers=False,
                                otlp_traces_endpoint=receiver.http_endpoint)
        [row] = await asyncio.to_thread(measure, config, tmp_path)
        traced_label = gateway_label(1, traced=True)
        assert row.labels == [gateway_label(1), traced_label] and row.errors(traced_label) == 0
        # The traced `kvgate serve` process exported every request it answered (flushed when it stopped).
        answered = row.runs[0].routed[traced_label].result.answers
        assert answered > 0
        assert len([s for s in receiver.spans if s.kind == "server" and s.service == "kvgate"]) == answered
