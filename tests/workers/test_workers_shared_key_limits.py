"""The API keys' limits workers share: one bucket per key, in-flight rows summed, a dead writer's rows cleared."""

from __future__ import annotations

import hashlib

import pytest

from kvgate.gateway.http.key_limits import TokenBucket
from kvgate.workers.shared_key_limits import SharedKeyLimit, SharedKeyLimits

A, B = hashlib.sha256(b"key-a").digest(), hashlib.sha256(b"key-b").digest()


@pytest.fixture
def block(tmp_path):
    created = SharedKeyLimits.create(str(tmp_path / "limits"), capacity=2, writers=2, lock_path=str(tmp_path / "lock"))
    yield created
    created.close()


def worker_limit(block: SharedKeyLimits, writer: int, digest: bytes, rate: float = 1.0, burst: int = 3,
                 now: float = 100.0) -> SharedKeyLimit:
    """A key's limit as one worker holds it: its own view of the same file."""
    view = SharedKeyLimits(block.path, block.lock_path)
    slot = view.claim(digest, burst, now)
    assert slot is not None
    return SharedKeyLimit(view, slot, writer, TokenBucket(rate, burst, now))


def test_one_bucket_per_key_whichever_worker_takes(block):
    first, second = worker_limit(block, 0, A), worker_limit(block, 1, A)
    assert [first.take(100.0), second.take(100.0), first.take(100.0)] == [0.0, 0.0, 0.0]
    assert second.take(100.0) == pytest.approx(1.0)  # the burst of 3 is spent, by both
    assert first.take(100.5) == pytest.approx(0.5)  # half a token refilled, for both
    assert second.take(101.0) == 0.0
    # A worker whose clock read came just before that take does not refill backwards.
    assert first.take(100.999) == pytest.approx(1.0)
    # Another key has its own bucket: its burst is whole.
    other = worker_limit(block, 1, B)
    assert [other.take(101.0) for _ in range(3)] == [0.0, 0.0, 0.0]


def test_a_worker_restarted_finds_its_keys_slot_by_digest_and_a_full_block_says_so(block):
    assert block.claim(A, 3, 0.0) == block.claim(A, 3, 5.0) == 0
    assert block.claim(B, 3, 0.0) == 1
    assert block.claim(hashlib.sha256(b"key-c").digest(), 3, 0.0) is None


def test_inflight_rows_are_summed_and_a_dead_writers_rows_cleared(block):
    first, second = worker_limit(block, 0, A), worker_limit(block, 1, A)
    assert first.enter() == 1
    assert second.enter() == 2
    assert first.enter() == 3
    first.leave()
    assert block.inflight(0) == 2
    block.clear_writer(1)  # the supervisor, once worker 1 died holding one request
    assert block.inflight(0) == 1
    assert second.enter() == 2
    assert worker_limit(block, 0, B).enter() == 1  # another key's count is its own
