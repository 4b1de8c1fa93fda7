"""The engine's own usage report for every answer, read on its way to the client.

Engines report how many prompt tokens they found cached in `usage.prompt_tokens_details.cached_tokens`
(vLLM when started with `--enable-prompt-tokens-details`, SGLang with `--enable-cache-report`): in
the JSON body of a whole answer, and in a stream only when the request asks for it with
`stream_options.include_usage`, as one last chunk with empty `choices` before `data: [DONE]`. So
when a streaming client did not ask for usage, the gateway asks the engine for it and removes that
chunk before relaying: the client sees exactly the stream it asked for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from kvgate.gateway.protocol import ParsedRequest

_USAGE_MARKER = b'"usage"'


def stream_options_asking_usage(parsed: ParsedRequest) -> dict[str, Any] | None:
    """The stream_options to send the engine when the gateway must ask for usage itself; None when
    the request is not a stream or already asks (types were checked by the parser)."""
    if not parsed.stream:
        return None
    options = parsed.body.get("stream_options") or {}
    if options.get("include_usage") is True:
        return None
    # continuous_usage_stats had no effect without include_usage: sent along, it would put usage
    # into every chunk the client receives.
    return {**{k: v for k, v in options.items() if k != "continuous_usage_stats"}, "include_usage": True}


# No prompt is longer: a larger count is an engine's bug, not a count.
MAX_REPORTED_TOKENS = 1 << 31


@dataclass(frozen=True, slots=True)
class ReportedUsage:
    prompt_tokens: int
    cached_tokens: int | None  # None: the engine does not report cached tokens (or reported nonsense)
    refused: tuple[str, ...] = ()  # fields whose numbers were impossible, refused or clamped


def reported_usage(usage: Any) -> ReportedUsage | None:
    """The usage object of an answer or chunk, if it is one. Numbers no engine can mean (negative,
    beyond MAX_REPORTED_TOKENS, more cached tokens than prompt tokens) are never passed on as they
    are: a negative count fed to a Prometheus counter raises, after the engine did the work."""
    if not isinstance(usage, dict) or type(usage.get("prompt_tokens")) is not int:
        return None
    prompt_tokens = usage["prompt_tokens"]
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    cached = cached if type(cached) is int else None
    refused = []
    if not 0 <= prompt_tokens <= MAX_REPORTED_TOKENS:
        refused.append("prompt_tokens")
        prompt_tokens = min(max(prompt_tokens, 0), MAX_REPORTED_TOKENS)
        cached = None  # nothing to judge it against
    elif cached is not None and not 0 <= cached <= prompt_tokens:
        refused.append("cached_tokens")
        cached = None if cached < 0 else prompt_tokens
    return ReportedUsage(prompt_tokens, cached, tuple(refused))


class UsageTap:
    """Watches one answer: keeps the last usage seen, and drops the usage chunk the gateway asked for."""

    def __init__(self, strip_usage_chunk: bool) -> None:
        self.strip_usage_chunk = strip_usage_chunk
        self.usage: ReportedUsage | None = None
        # A whole 200 answer, or a stream relayed to its end: its usage (or its lack) is the engine's word.
        self.answered = False

    def whole(self, body: bytes) -> None:
        """A whole JSON answer (status 200, not content-encoded)."""
        self.answered = True
        if _USAGE_MARKER not in body:
            return
        try:
            answer = orjson.loads(body)
        except orjson.JSONDecodeError:
            return
        if isinstance(answer, dict):
            self.usage = reported_usage(answer.get("usage")) or self.usage

    def events(self, data: bytes) -> bytes:
        """Complete SSE events as relayed; returns them minus the usage chunk the client did not ask for."""
        if _USAGE_MARKER not in data:
            return data  # the usual chunk: one substring search, no parsing
        kept = []
        for event in _split_events(data):
            if _USAGE_MARKER in event and self._is_usage_only(event):
                continue
            kept.append(event)
        return b"".join(kept)

    def end(self, rest: bytes) -> bytes:
        """The stream ended normally; `rest` are its last bytes (possibly none)."""
        self.answered = True
        return self.events(rest)

    def _is_usage_only(self, event: bytes) -> bool:
        """Reads the usage of `event`; True if the event is the usage chunk to remove."""
        payload = event.strip()
        if not payload.startswith(b"data:"):
            return False
        try:
            chunk = orjson.loads(payload[5:])
        except orjson.JSONDecodeError:
            return False
        if not isinstance(chunk, dict):
            return False
        usage = reported_usage(chunk.get("usage"))
        if usage is None:
            return False
        self.usage = usage
        return self.strip_usage_chunk and not chunk.get("choices")


def _split_events(data: bytes) -> list[bytes]:
    """`data` (whole events) cut after each blank line, separators kept so the bytes rejoin exactly."""
    events = []
    start = 0
    while start < len(data):
        lf, crlf = data.find(b"\n\n", start), data.find(b"\r\n\r\n", start)
        ends = [end + size for end, size in ((lf, 2), (crlf, 4)) if end >= 0]
        end = min(ends) if ends else len(data)
        events.append(data[start:end])
        start = end
    return events


def events_end(buffer: bytearray, start: int = 0) -> int:
    """Index just past the last complete SSE event in `buffer` (0 if none is complete); separators
    are looked for from `start` on."""
    lf, crlf = buffer.rfind(b"\n\n", start), buffer.rfind(b"\r\n\r\n", start)
    return max(lf + 2 if lf >= 0 else 0, crlf + 4 if crlf >= 0 else 0)
