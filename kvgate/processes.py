"""Child processes of kvgate's tools: free loopback ports, children that die with their parent,
a child with its output in a log file, and finding the programs kvgate starts.

Used by the service launchers (kvs_client/launch.py), the benchmarks and the tests alike.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from pathlib import Path

LOOPBACK = "127.0.0.1"
_LOG_TAIL_BYTES = 4000


class ServiceStartError(RuntimeError):
    """A local service did not become ready; the message holds its log tail."""


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


# Ports handed out for late binding by this process: never twice, though none is bound yet.
_LATE_PORTS: set[int] = set()
_LATE_PORTS_FROM = 10000


def free_port_for_late_bind(host: str = LOOPBACK) -> int:
    """A free port below the kernel's ephemeral range, for a service that binds it long after it is
    chosen: a vLLM engine binds its ports after loading the model, a minute later on a busy machine,
    and meanwhile an ephemeral port (what `free_port` returns) may become some outgoing connection's
    local port. The kernel never picks a port below that range on its own."""
    try:
        ephemeral_from = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return free_port(host)
    if ephemeral_from <= _LATE_PORTS_FROM + 1000:
        return free_port(host)
    for _ in range(200):
        port = random.randrange(_LATE_PORTS_FROM, ephemeral_from)
        if port in _LATE_PORTS:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
        _LATE_PORTS.add(port)
        return port
    return free_port(host)


def tcp_accepts(host: str, port: int, timeout_s: float = 0.2) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def die_with_parent(argv: list[str], signal_name: str = "KILL") -> list[str]:
    """Prefix argv so the child gets SIGKILL (or `signal_name`) if this process dies without cleaning up.

    `setpriv --pdeathsig` (util-linux) sets the parent-death signal, which survives the exec
    into the real program. The signal fires when the *thread* that forked exits, so it is only
    used from the main thread; elsewhere (and without setpriv) cleanup relies on stop().
    """
    setpriv = shutil.which("setpriv")
    if setpriv is None or threading.current_thread() is not threading.main_thread():
        return argv
    return [setpriv, "--pdeathsig", signal_name, "--", *argv]


_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with(parent_pid: int) -> None:
    """Called in a child process: SIGKILL it when `parent_pid`, its parent, dies (however it dies:
    kill -9 and the OOM killer included), and at once if that parent is already gone.

    Linux only (prctl's parent-death signal, bound to the parent *thread* that started this child,
    so start children from the main thread); elsewhere a no-op.
    """
    if sys.platform != "linux":
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:  # died before the signal was armed: it will never come
        os.kill(os.getpid(), signal.SIGKILL)


class LocalProcess:
    """A child process with its output in a log file; stop() always reaps it.

    With `process_group`, the child leads a process group of its own and is signalled as a group, so
    programs that fork helpers (vLLM's engine core and workers) leave none behind; `death_signal` is
    what it gets if this process dies first (TERM lets such a program stop its helpers itself).
    """

    def __init__(
        self,
        argv: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        process_group: bool = False,
        death_signal: str = "KILL",
    ) -> None:
        self.argv = argv
        self.log_path = log_path
        self._group = process_group
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(
            die_with_parent(argv, death_signal),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=process_group,
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-_LOG_TAIL_BYTES:]
        except OSError:
            return "<no log>"
        return data.decode("utf-8", "replace")

    def kill(self) -> None:
        """SIGKILL, as a crash would; used by fault tests. A group dies whole."""
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self, grace_s: float = 5.0) -> None:
        if self.alive():
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout=10)
        if self._group:
            self._signal(signal.SIGKILL)  # helpers the leader left behind
        self._log.close()

    def _signal(self, signum: int) -> None:
        try:
            if self._group:
                os.killpg(self.process.pid, signum)
            elif self.alive():
                self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def wait_ready(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise ServiceStartError(
                    f"{what} exited with code {self.process.returncode} during start-up "
                    f"({' '.join(self.argv)}); log tail:\n{self.log_tail()}"
                )
            if ready():
                return
            time.sleep(0.05)
        raise ServiceStartError(
            f"{what} not ready after {timeout_s:.0f}s ({' '.join(self.argv)}); log tail:\n{self.log_tail()}"
        )


def find_program(name: str) -> str | None:
    """`name` on PATH, else beside the running Python's own scripts: a virtualenv's bin/ holds the
    binaries its pip packages install (mooncake_master), and it is often not on PATH."""
    found = shutil.which(name)
    if found is not None:
        return found
    for directory in dict.fromkeys((sysconfig.get_path("scripts"), str(Path(sys.executable).parent))):
        found = shutil.which(name, path=directory)
        if found is not None:
            return found
    return None


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (Linux /proc): a gateway with workers is a supervisor and its children."""
    pids, index = [pid], 0
    while index < len(pids):
        for task in Path(f"/proc/{pids[index]}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                pids += [int(child) for child in task.read_text().split()]
        index += 1
    return pids
