"""The client API keys file (`--api-keys-file`): one key per line.

    # comments and blank lines are ignored
    team-search:3f9c0a7e51b24d6e8f0a1b2c3d4e5f60   <- name:key (the name shows in logs and metrics)
    9d8c7b6a5f4e3d2c1b0a99887766554433221100       <- a bare key, named key-<8 hex of its SHA-256>

A key is at least 16 characters without whitespace (`openssl rand -hex 24` makes a good one); a
name is what an instance id may be (letters, digits, `. _ : -`). The key itself is never logged.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

MIN_KEY_CHARS = 16
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True, slots=True)
class ApiKey:
    name: str
    key: str

    def __repr__(self) -> str:  # never print the key by accident
        return f"ApiKey({self.name!r})"


def load_api_keys(path: str) -> tuple[ApiKey, ...]:
    """The keys in the file; ValueError naming the line for anything malformed or duplicated."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"cannot read {path!r}: {exc.strerror}") from None
    keys: list[ApiKey] = []
    names: set[str] = set()
    secrets: set[str] = set()
    for number, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, colon, key = line.partition(":")
        if not colon:
            name, key = "key-" + hashlib.sha256(line.encode()).hexdigest()[:8], line
        where = f"{path} line {number}"
        if not _NAME.fullmatch(name):
            raise ValueError(f"{where}: a key name holds 1-64 letters, digits and . _ - ")
        if len(key) < MIN_KEY_CHARS or any(ch.isspace() for ch in key):
            raise ValueError(f"{where}: a key is at least {MIN_KEY_CHARS} characters without spaces")
        if name in names or key in secrets:
            raise ValueError(f"{where}: duplicated key or name {name!r}")
        names.add(name)
        secrets.add(key)
        keys.append(ApiKey(name, key))
    if not keys:
        raise ValueError(f"{path} holds no key: every client would be refused")
    return tuple(keys)
