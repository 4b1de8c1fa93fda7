"""`--account-sync`: other replicas' values are untrusted input, checked one by one against a real Redis.

A malformed value under the prefix (wrong type, wrong shape, negative or huge counts, 20 MB) is
dropped alone and counted; the round goes on, so a good peer's rows stay fresh, and nothing bad
reaches the account.
"""

from __future__ import annotations

import logging

import orjson
import pytest
import redis
from prometheus_client import CollectorRegistry

from kvgate.gateway.fleet.account_sync import KEY_PREFIX, AccountSync
from kvgate.metrics.definitions import account_sync_metrics
from kvgate.scheduler.account import LocalRows

pytestmark = [pytest.mark.redis, pytest.mark.timeout(60)]

GOOD = {"e0": (20, 3, 4000), "e1": (1, 0, 0)}


class Peer:
    """One replica's sync over LocalRows, with its metrics readable."""

    def __init__(self, redis_url: str, name: str, **limits) -> None:
        self.rows = LocalRows()
        self.registry = CollectorRegistry()
        self.sync = AccountSync(redis_url, self.rows, account_sync_metrics(self.registry), interval_s=1.0,
                                ttl_s=10.0, replica_id=name, **limits)

    def remote(self) -> dict:
        return {i: self.rows.summed(i) for i in ("e0", "e1", "e2") if self.rows.summed(i) != (0, 0, 0)}

    def metric(self, name: str, **labels) -> float:
        return self.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def peers(redis_url):
    good, reader = Peer(redis_url, "good"), Peer(redis_url, "reader", max_peers=8, max_row_bytes=64 * 1024)
    for instance_id, counts in GOOD.items():
        good.rows.write(instance_id, counts)
    await good.sync.sync_once()
    yield good, reader
    await good.sync.close()
    await reader.sync.close()


POISON = {
    # Each value is one class of bad input the issue found, with the reason it is dropped for.
    "a string": (b"hello", "not_json"),
    "a list of the wrong length": (orjson.dumps({"e0": [1, 2]}), "bad_schema"),
    "string counts": (orjson.dumps({"e0": ["1", "0", "0"]}), "bad_schema"),
    "booleans as counts": (orjson.dumps({"e0": [True, False, False]}), "bad_schema"),
    "a JSON list": (orjson.dumps([["e0", 1, 0, 0]]), "bad_schema"),
    "negative in flight": (orjson.dumps({"e0": [-1_000_000, 0, 0]}), "out_of_range"),
    "negative tokens": (orjson.dumps({"e0": [1, 0, -5]}), "out_of_range"),
    "more awaiting than in flight": (orjson.dumps({"e0": [1, 2, 0]}), "out_of_range"),
    "floats": (orjson.dumps({"e0": [1.5, 0, 0]}), "bad_schema"),
    "beyond int64": (b'{"e0": [9223372036854775808, 0, 0]}', "out_of_range"),
    "beyond 64 bits": (b'{"e0": [99999999999999999999999, 0, 0]}', "bad_schema"),
    "an invalid instance id": (orjson.dumps({"e/../0": [1, 0, 0]}), "bad_schema"),
    "a 20 MB value": (orjson.dumps({"e0": [1, 0, 0], "e1": [[0] * 10] * 1_000_000}), "too_large"),
    "non-UTF-8 bytes": (b"\xff\xfe{", "not_json"),
}


@pytest.mark.parametrize("label", POISON)
async def test_one_malformed_value_is_dropped_alone_and_counted(peers, redis_url, label):
    good, reader = peers
    value, reason = POISON[label]
    store = redis.Redis.from_url(redis_url)
    store.set(KEY_PREFIX + "poison", value)
    await reader.sync.sync_once()
    assert reader.remote() == GOOD  # the good peer's rows, nothing of the poisoned value
    assert reader.metric("kvgate_account_sync_rejected_total", reason=reason) == 1
    assert reader.metric("kvgate_account_sync_up") == 1 and reader.metric("kvgate_account_sync_failures_total") == 0
    assert reader.metric("kvgate_account_sync_replicas") == 1
    # The good peer goes idle: the reader follows at its next round although the poison stays.
    for instance_id in GOOD:
        good.rows.write(instance_id, (0, 0, 0))
    await good.sync.sync_once()
    await reader.sync.sync_once()
    assert reader.remote() == {}


async def test_values_of_other_redis_types_and_undecodable_key_names_are_dropped(peers, redis_url):
    good, reader = peers
    store = redis.Redis.from_url(redis_url)
    store.rpush(KEY_PREFIX + "a-list", b"1", b"2", b"3")
    store.hset(KEY_PREFIX + "a-hash", mapping={"e0": 5})
    store.sadd(KEY_PREFIX + "a-set", b"e0")
    store.set(KEY_PREFIX.encode() + b"\xff\xfe", orjson.dumps({"e2": [2, 0, 0]}))  # a well-formed value
    await reader.sync.sync_once()
    assert reader.remote() == {**GOOD, "e2": (2, 0, 0)}
    assert reader.metric("kvgate_account_sync_rejected_total", reason="wrong_type") == 3
    assert reader.metric("kvgate_account_sync_replicas") == 2


async def test_a_flood_of_keys_is_bounded_per_round_and_logged_once(peers, redis_url, caplog):
    _, reader = peers
    store = redis.Redis.from_url(redis_url)
    store.mset({f"{KEY_PREFIX}flood-{i}": b"not json" for i in range(50)})
    caplog.set_level(logging.INFO, logger="kvgate.gateway.fleet.account_sync")
    for _ in range(20):
        await reader.sync.sync_once()
    # At most max_peers (8) values read per round, the rest dropped as one count per round.
    assert reader.metric("kvgate_account_sync_rejected_total", reason="too_many_peers") == 20
    assert reader.metric("kvgate_account_sync_rejected_total", reason="not_json") <= 20 * 8
    drops = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 1 and len(drops[0].getMessage()) < 500
    assert reader.metric("kvgate_account_sync_up") == 1


async def test_a_round_that_fails_otherwise_says_so_and_drops_the_others_rows(peers, redis_url):
    _, reader = peers
    await reader.sync.sync_once()
    assert reader.remote() == GOOD

    class Broken(LocalRows):
        def local_totals(self):
            raise RuntimeError("a bug")

    reader.sync._rows = broken = Broken()
    broken.set_remote(dict(GOOD))
    await reader.sync.sync_once()  # never raises
    assert reader.metric("kvgate_account_sync_up") == 0
    assert reader.metric("kvgate_account_sync_failures_total") == 1
    assert broken.summed("e0") == (0, 0, 0)
