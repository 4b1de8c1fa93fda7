"""What another gateway replica published under the account-sync prefix, checked before it counts.

A peer's value is untrusted input: any process that can write to the Redis can put anything under
the prefix, and a buggy replica can publish nonsense. One bad value must never stop the sync round
(the other peers' rows would freeze) and must never reach the account: a negative count draws every
replica's traffic to one instance, a float or an integer beyond int64 breaks the workers' shared
table. So a value is accepted whole or dropped whole, with the reason it failed.

The accepted shape is what `AccountSync` publishes: a JSON object mapping an instance id to
`[requests in flight, requests awaiting their first token, their uncomputed prompt tokens]`, three
integers with 0 <= awaiting <= requests <= MAX_REQUESTS and 0 <= tokens <= MAX_TOKENS.
"""

from __future__ import annotations

import orjson

from kvgate.config.instance_rules import check_instance_id
from kvgate.scheduler.account import Counts

# Far beyond any real engine's concurrency, far below where sums over peers could overflow int64.
MAX_REQUESTS = 1_000_000
MAX_TOKENS = 1 << 40  # MAX_REQUESTS prompts of a million tokens each


class MalformedRows(ValueError):
    """A peer's value that does not count; `reason` is a metric label, str() the detail for the log."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def parse_peer_rows(raw: bytes) -> dict[str, Counts]:
    """The peer's rows, or MalformedRows (reason `not_json`, `bad_schema` or `out_of_range`)."""
    try:
        published = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise MalformedRows("not_json", f"not JSON ({exc})") from None
    if not isinstance(published, dict):
        raise MalformedRows("bad_schema", f"a JSON {type(published).__name__}, not an object")
    rows: dict[str, Counts] = {}
    for instance_id, counts in published.items():
        try:
            check_instance_id(instance_id)
        except ValueError:
            raise MalformedRows("bad_schema", f"instance id {instance_id[:64]!r} is not a valid id") from None
        rows[instance_id] = _counts(instance_id, counts)
    return rows


def _counts(instance_id: str, value: object) -> Counts:
    if not isinstance(value, list) or len(value) != 3 or any(type(v) is not int for v in value):
        raise MalformedRows("bad_schema", f"{instance_id}: expected three integers, got {_preview(value)}")
    requests, awaiting, tokens = value
    if not (0 <= awaiting <= requests <= MAX_REQUESTS and 0 <= tokens <= MAX_TOKENS):
        raise MalformedRows("out_of_range", f"{instance_id}: counts {_preview(value)} out of range")
    return requests, awaiting, tokens


def _preview(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
