"""Request parsing: the quick check for the usual bodies agrees with the full pydantic validation on
every body, valid or not (generated), and takes the usual shapes without it."""

from __future__ import annotations

from unittest import mock

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.gateway import protocol
from kvgate.gateway.errors import APIError
from kvgate.gateway.protocol import parse_chat, parse_completion, validated_chat, validated_completion

MISSING = object()
scalars = st.one_of(st.none(), st.booleans(), st.integers(-3, 2**33), st.floats(allow_nan=False),
                    st.text(max_size=5))
token_ids = st.lists(st.one_of(st.integers(-2, 2**32 + 1), st.booleans(), st.just("7")), max_size=4)
models = st.one_of(st.just(MISSING), st.sampled_from(["", "m", "other"]), scalars)
streams = st.one_of(st.just(MISSING), st.booleans(), scalars)
prompts = st.one_of(st.just(MISSING), scalars, token_ids, st.lists(st.one_of(st.text(max_size=3), token_ids),
                                                                    max_size=2))
contents = st.one_of(st.none(), st.text(max_size=3), scalars,
                     st.lists(st.one_of(st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=3)}),
                                        scalars), max_size=2))
roles = st.one_of(st.sampled_from(["user", "system", ""]), scalars)
message = st.fixed_dictionaries({"role": roles}, optional={"content": contents, "name": scalars})
messages = st.one_of(st.just(MISSING), scalars, st.lists(st.one_of(message, scalars, st.just({})), max_size=3))


def body_of(**fields) -> bytes:
    return orjson.dumps({name: value for name, value in fields.items() if value is not MISSING})


def outcome(parse, raw: bytes):
    try:
        return parse(raw)
    except APIError as error:
        return (error.status, error.message, error.param)


valid_models = st.sampled_from(["m", "other-model"])
valid_streams = st.one_of(st.just(MISSING), st.booleans())


def agrees(parse, validated, raw: bytes) -> bool:
    return outcome(parse, raw) == outcome(lambda r: validated(orjson.loads(r), r), raw)


@settings(max_examples=300, deadline=None)
@given(model=models, stream=streams, prompt=st.one_of(prompts, st.sampled_from(["x", [1, 2]])))
def test_completion_envelope_agrees_with_pydantic(model, stream, prompt):
    assert agrees(parse_completion, validated_completion, body_of(model=model, stream=stream, prompt=prompt))


@settings(max_examples=300, deadline=None)
@given(model=valid_models, stream=valid_streams, prompt=prompts)
def test_completion_prompts_agree_with_pydantic(model, stream, prompt):
    raw = body_of(model=model, stream=stream, prompt=prompt, max_tokens=3)
    assert agrees(parse_completion, validated_completion, raw)


@settings(max_examples=300, deadline=None)
@given(model=models, stream=streams, chat=st.one_of(messages, st.just([{"role": "user", "content": "q"}])))
def test_chat_envelope_agrees_with_pydantic(model, stream, chat):
    assert agrees(parse_chat, validated_chat, body_of(model=model, stream=stream, messages=chat))


@settings(max_examples=300, deadline=None)
@given(model=valid_models, stream=valid_streams,
       chat=st.lists(st.one_of(message, message, message, scalars, st.just({})), min_size=1, max_size=3))
def test_chat_messages_agree_with_pydantic(model, stream, chat):
    assert agrees(parse_chat, validated_chat, body_of(model=model, stream=stream, messages=chat))


@pytest.mark.parametrize("parse,body", [
    (parse_completion, {"model": "m", "prompt": "hello", "temperature": 0.1}),
    (parse_completion, {"model": "m", "prompt": [1, 2, 3], "stream": True}),
    (parse_chat, {"model": "m", "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "q"}]}),
])
def test_usual_bodies_skip_pydantic(parse, body):
    with mock.patch.object(protocol, "_validate", side_effect=AssertionError("pydantic was asked")):
        parsed = parse(orjson.dumps(body))
    assert parsed.model == "m" and parsed.body == body
