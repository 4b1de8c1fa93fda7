"""A MooncakeStorePublisher in a child process, driven over stdin/stdout JSON lines.

Why a child process: a Mooncake client whose master died takes ~17 s to close and its C++
threads keep logging; in a child it can simply be killed. It also keeps Mooncake's log noise
in a file instead of the parent's output.

Protocol (one JSON object per line):
  child -> parent at start: {"ready": true, "endpoint": "IP:port"} or {"ready": false, "error": "..."}
  parent -> child: {"op": "publish" | "withdraw", "keys": [...]}  -> {"ok": true, "failed": [...]}
                   ("publish" may carry "replica_num": copies on that many segments, this one first)
                   {"op": "close"}                                -> {"ok": true}, then exit
  any failure -> {"ok": false, "error": "..."}

Run by hand: python -m kvgate.kvs_client.publisher_process --local-ip 127.0.0.2 \
    --master 127.0.0.1:50051 --metadata-url http://127.0.0.1:8080/metadata
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from kvgate.kvs_client.mooncake_store_publisher import MooncakeStoreError, MooncakeStorePublisher
from kvgate.processes import die_with_parent


class PublisherProcessError(RuntimeError):
    """The child failed, answered with an error or did not answer in time."""


class PublisherProcess:
    """Parent-side handle of a publisher child. Blocking methods; `a*` variants run in a thread."""

    def __init__(
        self,
        local_ip: str,
        master_rpc_address: str,
        metadata_url: str,
        log_path: Path,
        start_timeout_s: float = 20.0,
    ) -> None:
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in _reap()
        argv = [
            sys.executable, "-m", "kvgate.kvs_client.publisher_process",
            "--local-ip", local_ip, "--master", master_rpc_address, "--metadata-url", metadata_url,
        ]
        # Mooncake logs at INFO to stderr by default; warnings and errors are enough in the file.
        env = dict(os.environ)
        env.setdefault("GLOG_minloglevel", "1")
        self._process = subprocess.Popen(
            die_with_parent(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env,
            text=True, bufsize=1,
        )
        try:
            hello = self._read_line(start_timeout_s, "start-up")
            if not hello.get("ready"):
                raise PublisherProcessError(f"publisher on {local_ip} failed to start: {hello.get('error')}")
        except BaseException:
            self.kill()
            raise
        self.endpoint: str = hello["endpoint"]

    def publish(self, keys: Sequence[str], timeout_s: float = 30.0, replica_num: int = 1) -> list[str]:
        """Store keys at this child's endpoint; returns the keys that failed."""
        message = {"op": "publish", "keys": list(keys), "replica_num": replica_num}
        return self._request(message, timeout_s)["failed"]

    def withdraw(self, keys: Sequence[str], timeout_s: float = 30.0) -> list[str]:
        return self._request({"op": "withdraw", "keys": list(keys)}, timeout_s)["failed"]

    def close(self, timeout_s: float = 10.0) -> None:
        """Close the store client cleanly (its keys disappear), killing the child if it hangs."""
        if self._process.poll() is None:
            try:
                self._request({"op": "close"}, timeout_s)
                self._process.wait(timeout=timeout_s)
            except (PublisherProcessError, subprocess.TimeoutExpired, OSError):
                self._process.kill()
        self._reap()

    def kill(self) -> None:
        """SIGKILL: the master forgets this client's keys only after its client TTL."""
        if self._process.poll() is None:
            self._process.kill()
        self._reap()

    async def apublish(self, keys: Sequence[str]) -> list[str]:
        return await asyncio.to_thread(self.publish, list(keys))

    async def awithdraw(self, keys: Sequence[str]) -> list[str]:
        return await asyncio.to_thread(self.withdraw, list(keys))

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    def __enter__(self) -> PublisherProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _request(self, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if self._process.poll() is not None:
            raise PublisherProcessError(f"publisher {self.endpoint} exited; log: {self.log_path}")
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(json.dumps(message) + "\n")
            self._process.stdin.flush()
        except OSError as exc:
            raise PublisherProcessError(f"publisher {self.endpoint}: cannot send: {exc}") from exc
        answer = self._read_line(timeout_s, message["op"])
        if not answer.get("ok"):
            raise PublisherProcessError(f"publisher {self.endpoint}: {message['op']} failed: {answer.get('error')}")
        return answer

    def _read_line(self, timeout_s: float, what: str) -> dict[str, Any]:
        stdout = self._process.stdout
        assert stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(stdout, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise PublisherProcessError(f"publisher: no answer to {what} within {timeout_s}s; log: {self.log_path}")
        line = stdout.readline()
        if not line:
            raise PublisherProcessError(f"publisher exited during {what}; log tail:\n{self._log_tail()}")
        return json.loads(line)

    def _log_tail(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-3000:]
        except OSError:
            return "<no log>"

    def _reap(self) -> None:
        self._process.wait(timeout=10)
        for stream in (self._process.stdin, self._process.stdout):
            if stream is not None:
                stream.close()
        self._log.close()


def _serve(publisher: MooncakeStorePublisher, requests: TextIO, answers: TextIO) -> None:
    def send(message: dict[str, Any]) -> None:
        answers.write(json.dumps(message) + "\n")
        answers.flush()

    for line in requests:
        try:
            request = json.loads(line)
            op = request["op"]
            if op == "close":
                publisher.close()
                send({"ok": True})
                return
            if op == "publish":
                send({"ok": True, "failed": publisher.publish(request["keys"], request.get("replica_num", 1))})
            elif op == "withdraw":
                send({"ok": True, "failed": publisher.withdraw(request["keys"])})
            else:
                send({"ok": False, "error": f"unknown op {op!r}"})
        except (ValueError, KeyError, TypeError, MooncakeStoreError) as exc:
            send({"ok": False, "error": f"{type(exc).__name__}: {exc}"})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--local-ip", required=True)
    parser.add_argument("--master", required=True, help="master RPC address IP:port")
    parser.add_argument("--metadata-url", required=True)
    parser.add_argument("--value-bytes", type=int, default=64)
    args = parser.parse_args(argv)

    # The protocol owns the real stdout; anything the C++ library prints goes to stderr.
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())

    publisher = MooncakeStorePublisher(
        args.local_ip, args.master, args.metadata_url, value_bytes=args.value_bytes
    )
    started = time.monotonic()
    try:
        publisher.open()
    except MooncakeStoreError as exc:
        answers.write(json.dumps({"ready": False, "error": str(exc)}) + "\n")
        answers.flush()
        return 1
    print(f"publisher {publisher.endpoint} ready in {time.monotonic() - started:.3f}s", file=sys.stderr)
    answers.write(json.dumps({"ready": True, "endpoint": publisher.endpoint}) + "\n")
    answers.flush()
    try:
        _serve(publisher, sys.stdin, answers)
    finally:
        publisher.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
