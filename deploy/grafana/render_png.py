"""Draw the dashboard's panels from a real run, for the docs (docs/img/dashboard.png).

    python deploy/grafana/render_png.py [--duration-s 90] [--out docs/img/dashboard.png]

Starts redis-server, mock engines behind kvgate gateways (kvgate/bench/dashboard.py) and a real
Prometheus (Debian package `prometheus`) scraping them every second, drives traffic, then asks
Prometheus for every panel's queries exactly as kvgate.json holds them and plots them with
matplotlib (the `plot` extra). Everything listens on loopback and is stopped on exit.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import aiohttp
import yaml

from kvgate.bench.dashboard import dashboard_fleet, exercise, load_panels
from kvgate.demo.fleet import free_port
from kvgate.gateway.planning.tokenizer import load_tokenizer
from kvgate.kvs_client.launch import start_redis_server

ROOT = Path(__file__).resolve().parents[2]
RATE_INTERVAL = "15s"  # Grafana's $__rate_interval at this scrape interval
STEP_S = 2


def _legend(template: str, labels: dict[str, str]) -> str:
    for name, value in labels.items():
        template = template.replace("{{" + name + "}}", value)
    return template


async def _wait_ready(session: aiohttp.ClientSession, url: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            async with session.get(url + "/-/ready") as answer:
                if answer.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError(f"Prometheus at {url} not ready after {timeout_s}s")


async def _query_range(session: aiohttp.ClientSession, url: str, expr: str, start: float, end: float) -> list:
    params = {"query": expr.replace("$__rate_interval", RATE_INTERVAL), "start": str(start), "end": str(end),
              "step": str(STEP_S)}
    async with session.get(url + "/api/v1/query_range", params=params) as answer:
        body = await answer.json()
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body.get('error')}")
    return body["data"]["result"]


def _plot(panels: list, results: list[list[list]], start: float, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 4
    rows = math.ceil(len(panels) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(columns * 5, rows * 2.9), squeeze=False)
    for axis, panel, series_per_target in zip(axes.flat, panels, results, strict=False):
        for target, series in zip(panel.targets, series_per_target, strict=True):
            for one in series:
                points = [(float(t) - start, float(v)) for t, v in one["values"] if math.isfinite(float(v))]
                if points:
                    xs, ys = zip(*points, strict=True)
                    axis.plot(xs, ys, linewidth=1, label=_legend(target.legend, one["metric"]))
        axis.set_title(panel.title, fontsize=9)
        axis.set_ylabel(panel.unit, fontsize=7)
        axis.tick_params(labelsize=7)
        axis.grid(alpha=0.3)
        if axis.has_data():
            axis.legend(fontsize=6, loc="upper left")
        else:
            axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes, color="grey")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle("kvgate dashboard (deploy/grafana/kvgate.json) over a run of mock engines; x: seconds",
                    fontsize=11)
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=60)


async def render(duration_s: float, out: Path, prometheus: str) -> None:
    panels = load_panels()
    with tempfile.TemporaryDirectory(prefix="kvgate-dashboard-") as tmp, start_redis_server(Path(tmp)) as redis:
        workdir = Path(tmp)
        async with dashboard_fleet(workdir, redis.url, replicas=2, time_scale=0.1,
                                   tokenizer=load_tokenizer()) as fleet:
            # honor_labels: kvgate's own `instance` label (the engine) is kept, as in the ServiceMonitor.
            groups = [{"targets": [gateway.url.split("//", 1)[1]], "labels": {"gateway": str(n)}}
                      for n, gateway in enumerate(fleet.gateways)]
            config = {"global": {"scrape_interval": "1s"},
                      "scrape_configs": [{"job_name": "kvgate", "honor_labels": True, "static_configs": groups}]}
            (workdir / "prometheus.yml").write_text(yaml.safe_dump(config))
            port = free_port()
            server = subprocess.Popen(
                [prometheus, f"--config.file={workdir / 'prometheus.yml'}", f"--storage.tsdb.path={workdir / 'tsdb'}",
                 f"--web.listen-address=127.0.0.1:{port}"],
                stdout=subprocess.DEVNULL, stderr=(workdir / "prometheus.log").open("w"))
            url = f"http://127.0.0.1:{port}"
            try:
                async with aiohttp.ClientSession() as session:
                    await _wait_ready(session, url)
                    start = time.time()
                    round_number = 0
                    while time.time() - start < duration_s:
                        await exercise(fleet, round_number)
                        round_number += 1
                        # Load that rises and falls, so latencies and in-flight counts move.
                        await asyncio.sleep(0.05 + 0.25 * (1 + math.sin(round_number / 8)))
                    await asyncio.sleep(3)  # the last scrapes
                    end = time.time()
                    results = [[await _query_range(session, url, t.expr, start, end) for t in panel.targets]
                               for panel in panels]
            finally:
                server.terminate()
                server.wait(timeout=30)
    _plot(panels, results, start, out)
    print(f"{out}: {len(panels)} panels, {round_number} rounds of traffic over {end - start:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--duration-s", type=float, default=90.0)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        raise SystemExit("render_png.py needs the prometheus binary (Debian: apt-get install prometheus)")
    asyncio.run(render(args.duration_s, args.out, prometheus))


if __name__ == "__main__":
    main()
