"""`kvgate serve` as an operator runs it: config checks, bad flags, and a real process serving."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request

import orjson
import pytest

from kvgate.processes import free_port

CONFIG = """
port: {port}
dispatch_policy: least_load
instances:
  - id: e0
    url: http://127.0.0.1:9
    model: m
    kvs_endpoints: ["127.0.0.2"]
"""


def kvgate(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def test_check_config_prints_a_summary(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(CONFIG.format(port=8123))
    result = kvgate("serve", "--config", str(path), "--check-config")
    assert result.returncode == 0, result.stderr
    assert "configuration OK" in result.stdout
    assert "e0: http://127.0.0.1:9 model=m" in result.stdout and "127.0.0.2" in result.stdout


@pytest.mark.parametrize("args,named", [
    (["--port", "70000"], "--port"),
    (["--dispatch-policy", "fastest"], "--dispatch-policy"),
    (["--tokenizer", "/nonexistent/tokenizer"], "--tokenizer"),
    (["--chat-template", "/nonexistent/template.jinja"], "--chat-template"),
])
def test_invalid_settings_exit_2_naming_the_flag(tmp_path, args, named):
    result = kvgate("serve", "--check-config", *args)
    assert result.returncode == 2
    assert named in result.stderr


def test_serve_answers_until_sigterm(tmp_path):
    port = free_port()
    path = tmp_path / "gateway.yaml"
    path.write_text(CONFIG.format(port=port))
    process = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as response:
                    models = orjson.loads(response.read())
                break
            except OSError:
                assert process.poll() is None, process.stderr.read()
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        assert [m["id"] for m in models["data"]] == ["m"]
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=20) == 0
        assert "event loop uvloop" in process.stderr.read()  # the fast loop is really the one serving
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def test_tune_gc_freezes_start_up_objects_and_raises_the_young_threshold():
    import gc

    from kvgate.gateway.core import GC_YOUNG_THRESHOLD, tune_gc

    threshold = gc.get_threshold()
    try:
        tune_gc()
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *threshold[1:])
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
