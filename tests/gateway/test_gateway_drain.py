"""SIGTERM drain of a real `kvgate serve` process: it stops accepting, lets a short stream finish,
ends a long one with an error event and `data: [DONE]`, logs an empty account and exits 0."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import aiohttp
import orjson

from kvgate.gateway.http.drain import DRAIN
from kvgate.gateway.http.server import start_gateway
from kvgate.gateway.state import GATEWAY
from kvgate.kvs_client.launch import free_port
from tests.gateway_helpers import gateway_settings, tokenizer, wait_until
from tests.scripted_upstream import MODEL, Script, ScriptedUpstream

GRACE_S = 3.0


async def _wait_serving(url: str, process: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    async with aiohttp.ClientSession() as session:
        while True:
            try:
                async with session.get(url + "/livez") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            assert process.poll() is None, process.stderr.read()
            assert time.monotonic() < deadline, "the gateway did not start"
            await asyncio.sleep(0.2)


async def _open_stream(session: aiohttp.ClientSession, url: str, model: str) -> aiohttp.ClientResponse:
    response = await session.post(url + "/v1/completions",
                                  json={"model": model, "prompt": "hello", "stream": True},
                                  headers={"X-Request-Id": f"rid-{model}"})
    assert response.status == 200
    assert (await response.content.readuntil(b"\n\n")).startswith(b"data: ")  # under way
    return response


def _events(body: bytes) -> list[bytes]:
    return [event.removeprefix(b"data: ") for event in body.split(b"\n\n") if event]


async def test_sigterm_drains_then_exits_zero(tmp_path):
    # The short stream ends well within the grace period; the long one would take 60 s.
    short = await ScriptedUpstream("short", Script(chunks=4, delay_s=0.3)).start()
    long = await ScriptedUpstream("long", Script(chunks=300, delay_s=0.2)).start()
    port = free_port()
    config = tmp_path / "gateway.yaml"
    config.write_text(
        # One process: its drain report is the one checked below (workers each report their own).
        f"port: {port}\nworkers: 1\nshutdown_grace_s: {GRACE_S}\naccess_log: true\ninstances:\n"
        f"  - {{id: e-short, url: '{short.url}', model: short}}\n"
        f"  - {{id: e-long, url: '{long.url}', model: long}}\n")
    process = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "serve", "--config", str(config)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               env={**os.environ, "HF_HUB_OFFLINE": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        await _wait_serving(url, process)
        async with aiohttp.ClientSession() as session:
            short_stream = await _open_stream(session, url, "short")
            long_stream = await _open_stream(session, url, "long")
            process.send_signal(signal.SIGTERM)
            started = time.monotonic()

            # New connections are refused while the streams still run.
            refused = False
            while not refused and time.monotonic() - started < GRACE_S:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                    writer.close()
                    await asyncio.sleep(0.05)
                except ConnectionRefusedError:
                    refused = True
            assert refused, "the gateway kept accepting connections after SIGTERM"

            short_events = _events(await short_stream.read())
            assert short_events[-1] == b"[DONE]" and len(short_events) == 4  # 3 left, then [DONE]
            assert all(b'"error"' not in event for event in short_events)

            long_events = _events(await long_stream.read())
            assert long_events[-1] == b"[DONE]"
            error = orjson.loads(long_events[-2])["error"]
            assert error["code"] == "shutting_down" and error["type"] == "server_error"
            assert len(long_events) < 300  # cut, not finished
        assert await asyncio.to_thread(process.wait, 30) == 0
        stderr = process.stderr.read().decode()
        assert "1 request(s) finished, 1 ended by the drain; in-flight account entries left: 0" in stderr
        assert long.cancelled == 1  # the engine was told to stop (connection closed)
        lines = [orjson.loads(line) for line in process.stdout.read().splitlines() if line.startswith(b"{")]
        access = {line["request_id"]: line for line in lines}
        assert access["rid-short"]["outcome"] == "ok" and access["rid-short"]["instance"] == "e-short"
        assert access["rid-long"]["outcome"] == "shutdown" and access["rid-long"]["instance"] == "e-long"
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        await short.close()
        await long.close()


async def test_drain_ends_a_request_still_waiting_for_its_engine_with_503_at_a_second_signal():
    # An engine that accepts and never answers: the request is cut by the drain, not by a timeout.
    held: list[asyncio.StreamWriter] = []
    closed_by_gateway: list[bytes] = []  # what each connection sent before the gateway closed it

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)
        closed_by_gateway.append(await reader.read())

    hung = await asyncio.start_server(hold, "127.0.0.1", 0)
    hung_url = f"http://127.0.0.1:{hung.sockets[0].getsockname()[1]}"
    handle = await start_gateway(gateway_settings({"h": hung_url}, MODEL), tokenizer=tokenizer())
    account = handle.app[GATEWAY].account
    try:
        async with aiohttp.ClientSession() as session:
            async def whole() -> tuple[int, dict]:
                async with session.post(handle.url + "/v1/completions", json={"model": MODEL, "prompt": "x"}) as r:
                    return r.status, await r.json()

            request = asyncio.create_task(whole())
            await wait_until(lambda: account.total_inflight() == 1)
            # A grace period far longer than the test: the operator's second signal ends it.
            draining = asyncio.create_task(handle.drain(600))
            await wait_until(lambda: handle.app[DRAIN].draining)
            handle.app[DRAIN].hurry()
            report = await asyncio.wait_for(draining, 30)
            status, payload = await request
        assert status == 503 and payload["error"]["code"] == "shutting_down"
        assert (report.finished, report.cut) == (0, 1)
        assert account.total_inflight() == 0
        # The engine was told to stop: the gateway closed the connection carrying the request.
        await wait_until(lambda: any(b"POST /v1/completions" in sent for sent in closed_by_gateway))
    finally:
        await handle.close()
        for writer in held:
            writer.close()
        hung.close()
