"""--tokenize-tail estimate: a text prompt tokenized only as far as routing needs, with the real
tokenizer, through real HTTP, mock engines and an embedded store."""

from __future__ import annotations

import logging
import random
import threading

import aiohttp
import openai
import pytest

from kvgate.config.settings import Settings, TokenizeTail
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.planning.prompt_encoding import PromptEncoding
from kvgate.gateway.planning.tokenizer import BACKGROUND_MAX_PENDING, PromptTooLong, TokenizerService
from kvgate.gateway.state import GATEWAY
from kvgate.mock_engine.server import MockEngineConfig, start_mock_engine
from tests.gateway_helpers import (
    EmbeddedFleet,
    assert_hang_up_released,
    assert_nothing_in_flight,
    counter_value,
    gateway_settings,
    read_events,
    tokenizer,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)

MODEL = "kvgate/mock-llm"
CHUNK = 16
WINDOW = 2 * CHUNK  # the planner's first window (prompt_window.WINDOW_CHUNKS store chunks)
# The estimate of a text in one style (prose lines here, the trace's words in the benchmark) is
# within this fraction of the real length.
ESTIMATE_TOLERANCE = 0.05
_WORDS = ("river", "stone", "light", "garden", "window", "signal", "harbor", "engine", "paper", "cloud",
          "seven", "quiet", "north", "market", "silver", "number", "forest", "bridge", "summer", "letter")


def prose(seed: int, lines: int) -> str:
    """Lines of words and numbers, each ending in a newline (a segment boundary)."""
    rng = random.Random(seed)
    return "".join(
        " ".join(rng.choice(_WORDS) for _ in range(12)) + f" {rng.randint(0, 99999)}.\n" for _ in range(lines)
    )


@pytest.fixture
def service():
    svc = TokenizerService(tokenizer(), cache_bytes=16 << 20)
    yield svc
    svc.close()


def full_ids(text: str, special: bool = True) -> list[int]:
    return tokenizer().encode(text, add_special_tokens=special)


# --- the tokenizer service ---


@pytest.mark.parametrize("seed", range(4))
def test_partial_ids_are_the_full_encodings_prefix_and_the_estimate_is_close(service, seed):
    text = prose(seed, 400)
    expected = full_ids(text)
    encoding = service.start_prompt_sync(text, window_tokens=64)
    assert not encoding.complete
    assert 64 <= len(encoding.ids) < len(expected) // 4
    assert encoding.ids == expected[: len(encoding.ids)]
    assert abs(encoding.total_tokens - len(expected)) <= ESTIMATE_TOLERANCE * len(expected)
    # Extending walks whole segments and stays exact; once complete the length is exact.
    while not encoding.complete:
        before = len(encoding.ids)
        service._grow(encoding, 256)
        assert len(encoding.ids) > before
        assert encoding.ids == expected[: len(encoding.ids)]
    assert encoding.ids == expected and encoding.total_tokens == len(expected)


def test_a_chat_is_rendered_once_and_encoded_partially(service):
    messages = [{"role": "system", "content": prose(7, 200)}, {"role": "user", "content": prose(8, 200)}]
    rendered = tokenizer().apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = tokenizer().encode(rendered, add_special_tokens=False)
    encoding = service.start_chat_sync(messages, window_tokens=64)
    assert not encoding.complete and encoding.text == rendered
    assert encoding.ids == expected[: len(encoding.ids)]
    assert abs(encoding.total_tokens - len(expected)) <= ESTIMATE_TOLERANCE * len(expected)


def test_leading_cached_segments_are_all_taken_before_the_window(service):
    history = prose(1, 300)
    service.encode_prompt_sync(history)
    text = history + prose(2, 300)
    encoding = service.start_prompt_sync(text, window_tokens=64)
    history_tokens = len(full_ids(history))
    assert history_tokens < len(encoding.ids) < history_tokens + 400
    assert encoding.ids == full_ids(text)[: len(encoding.ids)]


def test_a_prompt_that_may_exceed_the_limit_is_encoded_exactly(service):
    text = prose(3, 400)
    length = len(full_ids(text))
    assert len(text.encode()) > 3 * length  # the byte bound alone would not trust the estimate
    # Within half the limit the estimate is trusted...
    assert not service.start_prompt_sync(text, max_tokens=3 * length, window_tokens=64).complete
    # ...nearer, the prompt is counted whole, and refused on the exact count past the limit.
    for limit in (3 * length // 2, length + 10):
        near = service.start_prompt_sync(text, max_tokens=limit, window_tokens=64)
        assert near.complete and near.ids == full_ids(text) and near.total_tokens == length
    with pytest.raises(PromptTooLong) as refused:
        service.start_prompt_sync(text, max_tokens=length - 1, window_tokens=64)
    assert refused.value.tokens == length


async def test_background_completion_fills_the_cache(service):
    text = prose(4, 400)
    encoding = await service.start_prompt(text, window_tokens=64)
    ids_before = list(encoding.ids)
    outcomes: list[str] = []
    assert service.complete_in_background(encoding, outcomes.append)
    await wait_until(lambda: outcomes == ["completed"])
    assert encoding.ids == ids_before  # the plan holding them sees no change
    segments = service.cached_segments
    again = service.start_prompt_sync(text, window_tokens=64)
    assert again.complete and again.ids == full_ids(text)
    assert service.cached_segments == segments  # nothing new was encoded
    assert service.background_pending == 0


async def test_background_completions_are_bounded_and_failures_logged(service, caplog):
    held = threading.Event()
    service._background.submit(held.wait, 30)  # the background thread is busy
    try:
        texts = [prose(10 + i, 200) for i in range(BACKGROUND_MAX_PENDING + 1)]
        encodings = [service.start_prompt_sync(t, window_tokens=64) for t in texts]
        outcomes: list[str] = []
        assert service.complete_in_background(encodings[0], outcomes.append)
        # One pending completion per prompt...
        duplicate = service.start_prompt_sync(texts[0], window_tokens=64)
        assert not service.complete_in_background(duplicate, outcomes.append)
        # ...and at most BACKGROUND_MAX_PENDING in all: the rest is dropped, not queued.
        accepted = [service.complete_in_background(e, outcomes.append) for e in encodings[1:]]
        assert accepted == [True] * (BACKGROUND_MAX_PENDING - 1) + [False]
        assert service.background_pending == BACKGROUND_MAX_PENDING
    finally:
        held.set()
    await wait_until(lambda: len(outcomes) == BACKGROUND_MAX_PENDING)
    assert outcomes == ["completed"] * BACKGROUND_MAX_PENDING and service.background_pending == 0

    # A failing completion is logged and counted, and frees its place.
    broken = PromptEncoding("xy", ["x", None], [], [1], 0, encoded_segments=1, encoded_chars=1)  # type: ignore[list-item]
    with caplog.at_level(logging.ERROR, logger="kvgate.gateway.planning.tokenizer"):
        assert service.complete_in_background(broken, outcomes.append)
        await wait_until(lambda: len(outcomes) == BACKGROUND_MAX_PENDING + 1)
    assert outcomes[-1] == "failed" and "background tokenization" in caplog.text
    assert service.background_pending == 0


# --- the gateway: planning on a partial prompt ---

GATEWAY_SETTINGS = Settings(port=0, kvs_chunk_size=CHUNK, dispatch_policy="cache_aware",
                            cache_aware_scheduling_min_tokens=0, health_check_interval_s=60.0,
                            stats_poll_interval_s=60.0)
ENGINE = Settings(kvs_chunk_size=CHUNK)


async def schedule(url: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as session, session.post(url + "/debug/schedule", json=body) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def complete(url: str, **body) -> openai.types.Completion:
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30) as client:
        return await client.completions.create(**body)


def full_blocks(tokens: int) -> int:
    return tokens // CHUNK * CHUNK


async def test_the_store_holding_blocks_past_the_window_makes_the_planner_extend():
    shared = prose(20, 120)  # ~2,000 tokens, far past the first window
    async with EmbeddedFleet(GATEWAY_SETTINGS, {"e0": ENGINE, "e1": ENGINE}) as fleet:
        # e0 computed only the shared text's first lines, e1 all of it (sent straight to the
        # engines: the gateway's tokenize cache knows none of it, as a fresh replica's would not).
        short = shared[: shared.index("\n", 600) + 1]
        for engine, prompt in (("e0", short + prose(21, 5)), ("e1", shared + prose(22, 5))):
            await complete(fleet.engines[engine].url, model=MODEL, prompt=prompt, max_tokens=1)
        await fleet.flushed()
        body = {"model": MODEL, "prompt": shared + prose(23, 60), "max_tokens": 1}
        plan = await schedule(fleet.gateway.url, body)
        hits = {entry["id"]: entry["prefix_hit_tokens"] for entry in plan["instances"]}
        shared_tokens = len(full_ids(shared))
        # The window alone (~2 chunks past nothing cached) would have seen at most the short
        # prefix on both; the extension found e1's whole shared prefix.
        assert hits["e1"] == full_blocks(shared_tokens) > 8 * WINDOW
        assert hits["e0"] <= full_blocks(len(full_ids(short)))
        assert plan["selected"] == "e1"
        assert plan["prompt_tokens_estimated"] is True
        assert counter_value(fleet.gateway, "kvgate_tokenize_extensions_total") >= 3  # doubling from 2 chunks
        exact = len(full_ids(body["prompt"]))
        assert abs(plan["num_prompt_tokens"] - exact) <= ESTIMATE_TOLERANCE * exact
        assert plan["block_keys"] == fleet.gateway.app[GATEWAY].scheduler.block_keys(
            fleet.gateway.app[GATEWAY].scheduler.block_hashes(full_ids(body["prompt"])))[: len(plan["block_keys"])]

        # The real request goes there too, and the predicted hit (exact blocks) is what the engine reports.
        await complete(fleet.gateway.url, **body)
        assert counter_value(fleet.gateway, "kvgate_hit_comparisons_total", instance="e1", outcome="agree") == 1
        await assert_nothing_in_flight(fleet.gateway)


async def test_background_completion_lets_the_next_turn_find_its_prefix_cached():
    async with EmbeddedFleet(GATEWAY_SETTINGS, {"e0": ENGINE}) as fleet:
        gateway = fleet.gateway.app[GATEWAY]
        turn = prose(30, 150)
        await complete(fleet.gateway.url, model=MODEL, prompt=turn, max_tokens=1)
        assert counter_value(fleet.gateway, "kvgate_tokenize_estimated_prompts_total") == 1
        await wait_until(lambda: counter_value(fleet.gateway, "kvgate_tokenize_background_total",
                                               outcome="completed") == 1)
        # The next turn: its whole history is in the tokenize cache, so the window starts after it
        # and no extension is needed to see the engine's blocks.
        segments = gateway.tokenizer.cached_segments
        plan = await schedule(fleet.gateway.url, {"model": MODEL, "prompt": turn + prose(31, 40), "max_tokens": 1})
        assert len(plan["block_keys"]) * CHUNK >= full_blocks(len(full_ids(turn)))
        assert counter_value(fleet.gateway, "kvgate_tokenize_extensions_total") == 0
        assert gateway.tokenizer.cached_segments - segments <= 2  # only the window's new text
        # Repeating the first turn now needs no tokenizing at all: it is complete and exact.
        repeat = await schedule(fleet.gateway.url, {"model": MODEL, "prompt": turn, "max_tokens": 1})
        assert repeat["prompt_tokens_estimated"] is False
        assert repeat["num_prompt_tokens"] == len(full_ids(turn))
        await assert_nothing_in_flight(fleet.gateway)


@pytest.mark.parametrize("update", [{"forward_token_ids": True}, {"tokenize_tail": TokenizeTail.EXACT}],
                         ids=["forward-token-ids", "tokenize-tail-exact"])
async def test_prompts_stay_exact_where_every_id_is_read(update):
    async with EmbeddedFleet(GATEWAY_SETTINGS.model_copy(update=update), {"e0": ENGINE}) as fleet:
        text = prose(40, 150)
        plan = await schedule(fleet.gateway.url, {"model": MODEL, "prompt": text, "max_tokens": 1})
        assert plan["prompt_tokens_estimated"] is False
        assert plan["num_prompt_tokens"] == len(full_ids(text))
        answer = await complete(fleet.gateway.url, model=MODEL, prompt=text, max_tokens=1)
        assert answer.usage.prompt_tokens == len(full_ids(text))
        assert counter_value(fleet.gateway, "kvgate_tokenize_estimated_prompts_total") == 0
        if update.get("forward_token_ids"):
            # Chats are forwarded as text: they may still be estimated.
            chat = await schedule(fleet.gateway.url, {"model": MODEL, "max_tokens": 1,
                                                      "messages": [{"role": "user", "content": prose(41, 150)}]})
            assert chat["prompt_tokens_estimated"] is True


async def test_near_the_limit_the_prompt_is_counted_exactly():
    text = prose(50, 150)
    length = len(full_ids(text))
    for limit, status in ((length + 10, 200), (length - 1, 400)):
        settings = GATEWAY_SETTINGS.model_copy(update={"max_prompt_tokens": limit})
        async with EmbeddedFleet(settings, {"e0": ENGINE}) as fleet:
            async with (aiohttp.ClientSession() as session,
                        session.post(fleet.gateway.url + "/debug/schedule",
                                     json={"model": MODEL, "prompt": text, "max_tokens": 1}) as response):
                answer = await response.json()
            assert response.status == status, answer
            if status == 200:
                assert answer["prompt_tokens_estimated"] is False and answer["num_prompt_tokens"] == length
            else:
                assert answer["error"]["code"] == "context_length_exceeded"
                assert f"at least {length} tokens" in answer["error"]["message"]


async def test_a_client_hanging_up_on_an_estimated_prompt_leaves_nothing_in_flight():
    engine = await start_mock_engine(MockEngineConfig(time_scale=0.05), tokenizer=TokenizerService(tokenizer()))
    gateway = await start_gateway(gateway_settings({"e0": engine.url}, MODEL), tokenizer=tokenizer())
    try:
        async with openai.AsyncOpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0) as client:
            stream = await client.completions.create(model=MODEL, prompt=prose(60, 150), max_tokens=2000, stream=True)
            await read_events(stream, 3)
            await stream.close()
        assert counter_value(gateway, "kvgate_tokenize_estimated_prompts_total") == 1
        await assert_hang_up_released(gateway, engine.engine)
        await wait_until(lambda: gateway.app[GATEWAY].tokenizer.background_pending == 0)
        assert counter_value(gateway, "kvgate_tokenize_background_total", outcome="completed") == 1
    finally:
        await gateway.close()
        await engine.close()
