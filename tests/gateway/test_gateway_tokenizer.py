"""The tokenizer service must produce exactly the ids of a plain full encode, cache or not."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.gateway.errors import APIError
from kvgate.gateway.planning.tokenizer import (
    INLINE_MAX_CHARS,
    LONG_PROMPT_CHARS,
    ChatTemplateError,
    TokenizerLoadError,
    TokenizerService,
    default_tokenizer_dir,
    load_tokenizer,
)
from kvgate.gateway.protocol import add_special_tokens


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


@pytest.fixture()
def service(tokenizer):
    svc = TokenizerService(tokenizer, cache_bytes=1 << 20)
    yield svc
    svc.close()


def full_chat_ids(tokenizer, messages):
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def test_default_tokenizer_gets_the_default_template(tokenizer):
    assert "<｜User｜>" in tokenizer.chat_template
    text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert text == "<｜begin▁of▁sentence｜>S\n\n<｜User｜>Q<｜Assistant｜>"


def test_segmenting_is_enabled_for_the_default_tokenizer(service):
    # The start-up probe accepted line and turn-marker boundaries for this tokenizer.
    assert service._segmenter is not None


def test_growing_conversation_matches_full_encode_and_reuses_segments(tokenizer, service):
    messages = [{"role": "system", "content": "You are terse.\n" * 80}]
    for turn in range(12):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": f"turn {turn}: " + "lorem ipsum 42 数字!\n  more\n" * 30})
        before = service.cached_segments
        ids = service.encode_chat_sync(messages)
        assert ids == full_chat_ids(tokenizer, messages)
        # Only the new tail is tokenized: a handful of new segments, not the whole history again.
        assert service.cached_segments - before <= 6


def test_prompt_matches_full_encode_with_special_tokens(tokenizer, service):
    text = "Translate:\n" + "the cat sat on the mat. " * 400 + "\n<｜User｜>tail"
    assert service.encode_prompt_sync(text) == tokenizer.encode(text, add_special_tokens=True)
    assert service.encode_prompt_sync(text) == tokenizer.encode(text, add_special_tokens=True)  # cached


# Pieces chosen to straddle every boundary kind: spaces, newlines, digits, CJK, turn markers.
_PIECES = list("ab \n\t.,!?1234数字漢字é") + ["<｜User｜>", "<｜Assistant｜>", "  ", "\n\n", "word "]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=1500).map("".join)


@pytest.fixture()
def fine_service(tokenizer):
    """Every boundary taken (no merging of short segments), so random texts exercise each cut."""
    svc = TokenizerService(tokenizer, cache_bytes=1 << 20, min_segment_chars=1)
    yield svc
    svc.close()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=_TEXT)
def test_random_text_matches_full_encode(tokenizer, fine_service, text):
    assert fine_service.encode_prompt_sync(text) == tokenizer.encode(text, add_special_tokens=True)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(contents=st.lists(_TEXT, min_size=1, max_size=6))
def test_random_chats_match_full_encode(tokenizer, fine_service, contents):
    messages = [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]
    assert fine_service.encode_chat_sync(messages) == full_chat_ids(tokenizer, messages)


async def test_async_paths_run_long_prompts_in_the_executor(tokenizer, service):
    long_text = "word " * (INLINE_MAX_CHARS + 100)
    ids, short = await asyncio.gather(service.encode_prompt(long_text), service.encode_prompt("hi"))
    assert ids == tokenizer.encode(long_text) and short == tokenizer.encode("hi")
    messages = [{"role": "user", "content": long_text}]
    assert await service.encode_chat(messages, body_bytes=len(long_text)) == full_chat_ids(tokenizer, messages)


async def test_a_long_prompt_never_queues_a_medium_one_behind_it(tokenizer, service, monkeypatch):
    """Two long prompts' encodes are held until the medium ones are done: they must not wait for them
    (with one shared pool of two threads, both threads would be taken by the long ones)."""
    held = threading.Event()
    encode_plain = service._encode_plain

    def slow_for_long_texts(texts: list[str]) -> list[tuple[int, ...]]:
        if sum(map(len, texts)) > LONG_PROMPT_CHARS:
            held.wait(timeout=10)
        return encode_plain(texts)

    monkeypatch.setattr(service, "_encode_plain", slow_for_long_texts)
    long_texts = [f"word{n}\nother " * (LONG_PROMPT_CHARS // 5) for n in range(2)]
    medium = [f"medium {n} " * (INLINE_MAX_CHARS // 8) for n in range(4)]
    long_tasks = [asyncio.ensure_future(service.encode_prompt(text)) for text in long_texts]
    await asyncio.sleep(0.05)  # the long ones are being encoded
    encoded = await asyncio.wait_for(asyncio.gather(*map(service.encode_prompt, medium)), timeout=5)
    assert encoded == [tokenizer.encode(m) for m in medium]
    assert not any(task.done() for task in long_tasks)
    held.set()
    assert await asyncio.gather(*long_tasks) == [tokenizer.encode(text) for text in long_texts]


def test_text_parts_are_joined_and_media_parts_left_out(tokenizer, service):
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert service.encode_chat_sync(parts) == full_chat_ids(tokenizer, [{"role": "user", "content": "a\nb"}])
    media = [{"role": "user", "content": [
        {"type": "text", "text": "a"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
        {"type": "text", "text": "b"},
    ]}]
    assert service.encode_chat_sync(media) == service.encode_chat_sync(parts)
    with pytest.raises(ChatTemplateError, match="'type'"):
        service.encode_chat_sync([{"role": "user", "content": [{"text": "x"}]}])
    with pytest.raises(ChatTemplateError, match="unsupported message role"):
        service.encode_chat_sync([{"role": "wizard", "content": "x"}])


def test_missing_tokenizer_or_template_names_the_flag(tmp_path):
    with pytest.raises(TokenizerLoadError, match="--tokenizer"):
        load_tokenizer(str(tmp_path / "nowhere"))
    with pytest.raises(TokenizerLoadError, match="--chat-template"):
        load_tokenizer("", str(tmp_path / "missing.jinja"))


def test_custom_template_file_is_used(tmp_path):
    path = tmp_path / "t.jinja"
    path.write_text("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
    tok = load_tokenizer("", str(path))
    svc = TokenizerService(tok)
    try:
        assert svc.render_chat([{"role": "user", "content": "x"}]) == "[user]x"
    finally:
        svc.close()


def test_tokenizer_whose_boundaries_are_not_independent_falls_back_to_whole_texts():
    # A SentencePiece-style tokenizer prepends "▁" to the first word of every encode, so a cut
    # after a newline would change the ids: the start-up probe must notice and disable cutting.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = sorted({w for line in ("The quick brown fox 12345 times", "x") for w in line.split()})
    vocab = {"[UNK]": 0, "▁": 1, "\n": 2}
    for w in words:
        vocab.setdefault("▁" + w, len(vocab))
        vocab.setdefault(w, len(vocab))
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    svc = TokenizerService(tok)
    try:
        assert svc._segmenter is None
        text = "The quick\nbrown fox\n" * 200
        assert svc.encode_prompt_sync(text) == tok.encode(text)
    finally:
        svc.close()


def test_the_cache_accounts_what_its_entries_really_cost_and_stays_under_its_bytes(tokenizer):
    import tracemalloc

    capacity = 4 << 20
    svc = TokenizerService(tokenizer, cache_bytes=capacity)
    def texts(first: int, last: int) -> list[str]:
        return [f"doc {i}\n" + "lorem ipsum dolor sit amet, " * 2000 for i in range(first, last)]  # ~56 KB

    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for text in texts(0, 8):  # made here so that the cache alone keeps them afterwards
            svc.encode_prompt_sync(text)
        measured = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # What the cache says it holds is what the process really holds for it (within 15%).
    assert abs(svc.cached_bytes - measured) < 0.15 * measured, (svc.cached_bytes, measured)
    later = texts(8, 64)
    for text in later:
        svc.encode_prompt_sync(text)
    assert 0 < svc.cached_bytes <= capacity
    assert svc.encode_prompt_sync(later[0]) == tokenizer.encode(later[0])  # evicted, encoded again exactly
    svc.close()


def test_a_segment_over_an_eighth_of_the_cache_is_not_cached(tokenizer):
    svc = TokenizerService(tokenizer, cache_bytes=64 * 1024)
    svc.encode_prompt_sync("x " * 20000)  # one line of 40 KB: over 8 KB
    assert svc.cached_segments == 0
    svc.close()


def test_prompts_over_max_tokens_are_refused_before_and_after_encoding(tokenizer):
    from kvgate.gateway.planning.tokenizer import PromptTooLong

    svc = TokenizerService(tokenizer)
    text = "hello " * 1000
    exact = len(svc.encode_prompt_sync(text))
    assert len(svc.encode_prompt_sync(text, max_tokens=exact)) == exact
    with pytest.raises(PromptTooLong) as refused:
        svc.encode_prompt_sync(text, max_tokens=exact - 1)
    assert refused.value.tokens == exact
    # Far over the limit (more than 4 characters per allowed token): counted first, refused unencoded.
    with pytest.raises(PromptTooLong) as counted:
        svc.encode_prompt_sync("hello " * 10000, max_tokens=100)
    assert counted.value.tokens > 100 and svc.cached_segments == 1  # only the first text was cached
    with pytest.raises(PromptTooLong):
        svc.encode_chat_sync([{"role": "user", "content": text}], max_tokens=exact - 1)
    svc.close()


def test_the_prompt_limit_comes_from_the_flag_the_instances_or_the_tokenizer():
    from types import SimpleNamespace

    from kvgate.config.settings import InstanceConfig
    from kvgate.gateway.planning.prompt_limit import FALLBACK_MAX_PROMPT_TOKENS, PromptLimit

    instances = [InstanceConfig(id="a", url="http://127.0.0.1:1", model="m", max_model_len=8192),
                 InstanceConfig(id="b", url="http://127.0.0.1:2", model="m", max_model_len=32768),
                 InstanceConfig(id="c", url="http://127.0.0.1:3", model="other")]
    known = SimpleNamespace(model_max_length=16384)
    unknown = SimpleNamespace(model_max_length=int(1e30))  # Hugging Face's "not set"
    assert PromptLimit(0, known, instances).tokens("m") == 32768  # the largest context serving "m"
    assert PromptLimit(0, known, instances).tokens("other") == 16384
    assert PromptLimit(0, unknown, instances).tokens("other") == FALLBACK_MAX_PROMPT_TOKENS
    assert PromptLimit(1000, known, instances).tokens("m") == 1000
    limit = PromptLimit(0, known, instances)
    limit.set_instances(instances[:1])  # "b" removed at run time
    assert limit.tokens("m") == 8192


def test_add_special_tokens_follows_the_request(tmp_path):
    """With a tokenizer that adds BOS (as Llama's do), completions get it unless the request says
    add_special_tokens: false, and chats only when it says true (as vLLM encodes them)."""
    source = Path(default_tokenizer_dir())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, tmp_path / name)
    spec = json.loads((tmp_path / "tokenizer.json").read_text())
    bos = "<｜begin▁of▁sentence｜>"
    spec["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {bos: {"id": bos, "ids": [0], "tokens": [bos]}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    service = TokenizerService(load_tokenizer(str(tmp_path)))
    bare = service.encode_prompt_sync("hello there", add_special_tokens=False)
    assert add_special_tokens({}, chat=False) and not add_special_tokens({"add_special_tokens": False}, chat=False)
    assert service.encode_prompt_sync("hello there") == [0, *bare]
    chat = [{"role": "user", "content": "hi"}]
    assert not add_special_tokens({}, chat=True) and add_special_tokens({"add_special_tokens": True}, chat=True)
    assert service.encode_chat_sync(chat, add_special_tokens=True) == [0, *service.encode_chat_sync(chat)]
    with pytest.raises(APIError):
        add_special_tokens({"add_special_tokens": "no"}, chat=False)
