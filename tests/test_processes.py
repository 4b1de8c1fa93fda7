"""Finding the programs kvgate starts: on PATH, else beside the running Python's scripts."""

from __future__ import annotations

import os
import socket
import stat
import sys
from pathlib import Path

from kvgate.processes import LOOPBACK, find_program, free_port_for_late_bind


def test_a_program_beside_the_python_is_found_without_path(monkeypatch, tmp_path):
    # What a virtualenv not on PATH looks like: the interpreter and its scripts in one bin/.
    scripts = tmp_path / "venv-bin"
    scripts.mkdir()
    program = scripts / "kvgate-test-program"
    program.write_text("#!/bin/sh\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setattr(sys, "executable", str(scripts / "python"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert find_program("kvgate-test-program") == str(program)
    assert find_program("kvgate-no-such-program") is None


def test_path_comes_first(monkeypatch, tmp_path):
    on_path = tmp_path / "kvgate-test-program"
    on_path.write_text("#!/bin/sh\n")
    on_path.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path) + os.pathsep + os.environ.get("PATH", ""))
    assert Path(find_program("kvgate-test-program")) == on_path


def test_ports_for_late_binding_are_distinct_bindable_and_never_ephemeral():
    """A port a service binds a minute after it is chosen must not be one the kernel may meanwhile
    give an outgoing connection."""
    ephemeral_from = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port_for_late_bind() for _ in range(50)]
    assert len(set(ports)) == 50
    assert all(port < ephemeral_from for port in ports)
    for port in ports[:5]:
        with socket.socket() as sock:
            sock.bind((LOOPBACK, port))
