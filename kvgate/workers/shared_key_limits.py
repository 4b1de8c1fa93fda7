"""The API keys' limits every worker of one gateway shares, so a key's rate and in-flight limits
hold for the gateway, not once per worker.

A second memory-mapped file beside the instance table (shared_table.py), in 8-byte words:

    header   capacity | writers
    slots    per key slot: used | SHA-256 digest of the key (4 words) | tokens (float) | updated (float)
    rows     per slot, per writer: requests in flight

A key is found by its digest, never by its position in the keys file: a worker restarted after the
file changed finds its keys' slots, and a key new to the file claims a free one (none left: the
worker counts that key alone, auth.py says so). Slots are claimed when a worker starts, under the
block's own file lock. A key's bucket is one (tokens, updated) pair every worker takes from under
that lock, held for the microseconds of one refill (the kernel releases it if its holder dies).
In-flight rows have a single writer each, so the request path takes no lock for them: a decision
sums the key's rows, and the supervisor zeroes a dead worker's rows before restarting it.
"""

from __future__ import annotations

import contextlib
import fcntl
import struct
from collections.abc import Iterator

from kvgate.gateway.http.key_limits import TokenBucket
from kvgate.workers.shared_table import map_words

_WORD = 8
_HEADER_WORDS = 2
_DIGEST_WORDS = 4
_SLOT_WORDS = 1 + _DIGEST_WORDS + 2
_TOKENS, _UPDATED = 1 + _DIGEST_WORDS, 2 + _DIGEST_WORDS
# Room for keys added to the file while the gateway runs (a restarted worker loads the new file).
_MIN_SLOTS = 64


def key_slots(keys_at_start: int) -> int:
    """The block's capacity for a gateway started with `keys_at_start` keys."""
    return max(_MIN_SLOTS, 2 * keys_at_start)


class SharedKeyLimits:
    """A view of the key limits block: `create`d by the supervisor, opened by each worker."""

    def __init__(self, path: str, lock_path: str) -> None:
        self.path = path
        self.lock_path = lock_path
        self._map, self._q, self._d = map_words(path)
        self.capacity, self.writers = self._q[0], self._q[1]
        self._rows_at = _HEADER_WORDS + self.capacity * _SLOT_WORDS
        self._key_rows = struct.Struct(f"{self.writers}q")
        # Opened once: the rate limit takes the lock on every request.
        self._lock = open(lock_path, "a")  # noqa: SIM115 - held for the view's life

    @classmethod
    def create(cls, path: str, capacity: int, writers: int, lock_path: str) -> SharedKeyLimits:
        with open(path, "wb") as file:
            file.write(struct.pack("2q", capacity, writers))
            file.truncate((_HEADER_WORDS + capacity * (_SLOT_WORDS + writers)) * _WORD)
        return cls(path, lock_path)

    def close(self) -> None:
        """Unmap and drop the lock file (the supervisor removes both with its run directory)."""
        for view in (self._q, self._d):
            view.release()
        self._map.close()
        self._lock.close()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._lock, fcntl.LOCK_UN)

    def claim(self, digest: bytes, burst: int, now: float) -> int | None:
        """The slot of the key with this digest, claimed (its bucket full at `now`) if no worker did
        before; None when every slot holds another key."""
        with self._locked():
            free = None
            for slot in range(self.capacity):
                at = _HEADER_WORDS + slot * _SLOT_WORDS
                if not self._q[at]:
                    free = slot if free is None else free
                elif self._map[(at + 1) * _WORD : (at + 1 + _DIGEST_WORDS) * _WORD] == digest:
                    return slot
            if free is not None:
                at = _HEADER_WORDS + free * _SLOT_WORDS
                self._map[(at + 1) * _WORD : (at + 1 + _DIGEST_WORDS) * _WORD] = digest
                self._d[at + _TOKENS], self._d[at + _UPDATED] = float(burst), now
                self._q[at] = 1
            return free

    def take(self, slot: int, bucket: TokenBucket, now: float) -> float:
        """`bucket.take(now)` on the slot's shared bucket: 0 if a token was taken, else the seconds to wait."""
        at = _HEADER_WORDS + slot * _SLOT_WORDS
        d = self._d
        with self._locked():
            bucket.tokens, bucket.updated = d[at + _TOKENS], d[at + _UPDATED]
            # A clock read just before another worker's take is not a refill backwards.
            wait_s = bucket.take(max(now, bucket.updated))
            d[at + _TOKENS], d[at + _UPDATED] = bucket.tokens, bucket.updated
        return wait_s

    def enter(self, writer: int, slot: int) -> int:
        """One more request in `writer`'s row of the slot; returns the key's sum over every writer."""
        self._q[self._rows_at + slot * self.writers + writer] += 1
        return self.inflight(slot)

    def leave(self, writer: int, slot: int) -> None:
        self._q[self._rows_at + slot * self.writers + writer] -= 1

    def inflight(self, slot: int) -> int:
        return sum(self._key_rows.unpack_from(self._map, (self._rows_at + slot * self.writers) * _WORD))

    def clear_writer(self, writer: int) -> None:
        """A dead writer's requests leave every key's count (the supervisor calls this before restarting it)."""
        for slot in range(self.capacity):
            self._q[self._rows_at + slot * self.writers + writer] = 0


class SharedKeyLimit:
    """One key's `KeyLimit` (kvgate/gateway/http/key_limits.py) in the shared block, as one worker counts it."""

    __slots__ = ("_block", "_slot", "_writer", "_bucket")

    def __init__(self, block: SharedKeyLimits, slot: int, writer: int, bucket: TokenBucket | None) -> None:
        self._block = block
        self._slot = slot
        self._writer = writer
        self._bucket = bucket  # the arithmetic; its state is loaded from the block on each take

    def take(self, now: float) -> float:
        return 0.0 if self._bucket is None else self._block.take(self._slot, self._bucket, now)

    def enter(self) -> int:
        return self._block.enter(self._writer, self._slot)

    def leave(self) -> None:
        self._block.leave(self._writer, self._slot)
