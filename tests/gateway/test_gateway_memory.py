"""Bounded memory and a responsive event loop, measured on a real `kvgate serve` process: RSS read
from /proc while huge prompts arrive, /health latency while a chat of 200,000 messages renders."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

import orjson
import pytest

from kvgate.kvs_client.launch import free_port

MB = 1024 * 1024
CACHE_BYTES = 16 * MB
MAX_PROMPT_TOKENS = 400_000  # the 200K-token prompts pass, the 1.3M-token one is counted and refused
# One process (workers: 1): its RSS and its own tokenize cache are what is measured.
CONFIG = """
port: {port}
workers: 1
tokenize_cache_bytes: {cache}
max_prompt_tokens: {max_prompt}
kvs_backend: embedded
health_check_interval_s: 60
instances:
  - id: e0
    url: http://127.0.0.1:9
    model: m
"""


@dataclass
class Served:
    url: str
    pid: int

    def rss_mb(self) -> float:
        with open(f"/proc/{self.pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def post(self, path: str, body: dict, timeout_s: float = 60) -> tuple[int, dict]:
        request = urllib.request.Request(self.url + path, data=orjson.dumps(body),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, orjson.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, orjson.loads(error.read())

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        raise AssertionError(f"{name} not exported")


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[Served]:
    port = free_port()
    path = tmp_path_factory.mktemp("memory") / "gateway.yaml"
    path.write_text(CONFIG.format(port=port, cache=CACHE_BYTES, max_prompt=MAX_PROMPT_TOKENS))
    process = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(path)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).close()
                break
            except OSError:
                assert process.poll() is None, process.stderr.read()
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.2)
        yield Served(url, process.pid)
    finally:
        process.kill()
        process.wait()


def peak_rss_while(served: Served, action) -> tuple[float, object]:
    """The process's highest RSS (sampled every 10 ms) while `action()` runs, and its result."""
    peak = served.rss_mb()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, served.rss_mb())
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        result = action()
    finally:
        done.set()
        sampler.join()
    return peak, result


def test_distinct_huge_prompts_stay_within_the_tokenize_cache_bytes(served):
    # Before the cache was bounded in bytes each of these held ~11.5 MB (a tuple of Python ints).
    def prompt(i: int) -> dict:
        return {"model": "m", "prompt": f"w{i} " + "hello " * 200000}

    assert served.post("/debug/schedule", prompt(0))[0] == 200  # warm-up: executor threads, arenas
    before = served.rss_mb()
    for i in range(1, 13):
        status, plan = served.post("/debug/schedule", prompt(i))
        assert status == 200 and plan["num_prompt_tokens"] > 200_000
    grown = served.rss_mb() - before
    print(f"RSS {before:.0f} -> {before + grown:.0f} MB")
    assert served.metric("kvgate_tokenize_cache_bytes") <= CACHE_BYTES
    # 12 prompts held whole added ~180 MB; the cache may hold 16 MB, the rest is allocator slack.
    assert grown < CACHE_BYTES / MB + 64, f"RSS grew {grown:.0f} MB"


def test_a_13m_token_prompt_is_refused_in_bounded_memory(served):
    body = {"model": "m", "prompt": "hello " * 1_300_000}  # 7.8 MB, under the body limit
    before = served.rss_mb()
    peak, (status, answer) = peak_rss_while(served, lambda: served.post("/v1/completions", body))
    print(f"RSS {before:.0f} MB, peak {peak:.0f} MB, after {served.rss_mb():.0f} MB")
    assert status == 400
    assert answer["error"]["code"] == "context_length_exceeded"
    assert answer["error"]["param"] == "prompt" and str(MAX_PROMPT_TOKENS) in answer["error"]["message"]
    # Tokenized whole, it peaked ~650 MB above the start and ~500 MB stayed.
    assert peak - before < 250, f"peak RSS {peak - before:.0f} MB above the start"
    assert served.rss_mb() - before < 100


def test_prompt_token_ids_over_the_limit_are_refused(served):
    status, answer = served.post("/v1/completions", {"model": "m", "prompt": [7] * (MAX_PROMPT_TOKENS + 1)})
    assert status == 400 and answer["error"]["code"] == "context_length_exceeded"


def test_health_answers_while_200000_empty_messages_render(served):
    body = {"model": "m", "messages": [{"role": "user", "content": ""}] * 200_000}
    latencies: list[float] = []
    done = threading.Event()

    def poll_health() -> None:
        while not done.is_set():
            started = time.perf_counter()
            urllib.request.urlopen(served.url + "/health", timeout=30).close()
            latencies.append(time.perf_counter() - started)
            time.sleep(0.005)

    poller = threading.Thread(target=poll_health)
    poller.start()
    started = time.perf_counter()
    try:
        status, plan = served.post("/debug/schedule", body)
    finally:
        busy_s = time.perf_counter() - started
        done.set()
        poller.join()
    print(f"/health worst {max(latencies) * 1000:.0f} ms over {len(latencies)} probes; request {busy_s:.2f} s")
    assert status == 200 and plan["num_prompt_tokens"] > 200_000
    # Rendered on the loop, /health waited for the whole rendering (most of the request's time).
    assert max(latencies) < busy_s / 2, (max(latencies), busy_s)
