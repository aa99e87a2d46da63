"""A real Prometheus (Debian's package) scrapes the real server: what it stores is what was run.

The test starts its own ``prometheus`` on a free loopback port, with its own configuration and
data directory, scraping the server under test every second with a reader's bearer token; it stops
it and removes both at the end. ``promtool`` checks the text the server exposes.
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, free_port, make_test_config, wait_until
from mcp import Client
from mcp.client.streamable_http import streamable_http_client

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("prometheus") is None, reason="Debian's prometheus package is not installed"),
]
TOKENS = {"ops": "ops-token-83be1d", "alice": "alice-token-5f2c77"}
STATELESS_RUNS, SESSION_RUNS = 5, 4
CONFIG = """
image = "{image}"
[limits]
memory_mb = 256
default_timeout_s = 20
[pool]
size = 2
session_spares = 1
[sessions]
durable = false  # its sessions end with the server: nothing is left on the engine
[metrics]
readers = ["ops"]
[http.tokens]
ops = "{ops}"
alice = "{alice}"
"""
SCRAPE = """
global:
  scrape_interval: 1s
  evaluation_interval: 1s
scrape_configs:
  - job_name: mcpx
    scrape_interval: 1s
    scrape_timeout: 1s
    authorization:
      credentials_file: {token_file}
    static_configs:
      - targets: ["127.0.0.1:{port}"]
"""


@pytest.fixture(scope="module")
async def server(service: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    # (The suite's shared service is set up first, as in test_clients_over_http.)
    path = tmp_path_factory.mktemp("metrics") / "config.toml"
    path.write_text(CONFIG.format(image=make_test_config().image, **TOKENS))
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


@pytest.fixture(scope="module")
def prometheus(server: ServerProcess, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A Prometheus of the test's own on loopback; its base URL."""
    where = tmp_path_factory.mktemp("prometheus")
    (where / "token").write_text(TOKENS["ops"])
    (where / "prometheus.yml").write_text(SCRAPE.format(token_file=where / "token", port=server.port))
    port = free_port()
    log = (where / "log").open("wb")
    process = subprocess.Popen(
        [
            "prometheus",
            f"--config.file={where / 'prometheus.yml'}",
            f"--storage.tsdb.path={where / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
        ],
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        shutil.rmtree(where, ignore_errors=True)


@asynccontextmanager
async def connect(server: ServerProcess, who: str) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(headers={"Authorization": f"Bearer {TOKENS[who]}"}, timeout=60)
    async with http, Client(streamable_http_client(f"{server.url}/mcp", http_client=http)) as client:
        yield client


def query(prometheus: str, promql: str) -> list[dict[str, Any]]:
    """An instant query's result vector (empty while Prometheus has nothing for it)."""
    answer = httpx2.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=5)
    answer.raise_for_status()
    body = answer.json()
    assert body["status"] == "success", body
    return list(body["data"]["result"])


def value(prometheus: str, promql: str) -> float | None:
    found = query(prometheus, promql)
    return float(found[0]["value"][1]) if found else None


def scraped(server: ServerProcess, who: str = "ops") -> httpx2.Response:
    return httpx2.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {TOKENS[who]}"}, timeout=10)


async def test_prometheus_stores_the_runs_the_durations_and_the_warm_pool_that_healthz_shows(
    server: ServerProcess, prometheus: str
) -> None:
    # Up and scraped before any run: the counters it stores start from what the server had.
    await wait_until(lambda: value_or_none(prometheus, 'up{job="mcpx"}') == 1, 60, every_s=0.5)
    before = value(prometheus, 'sum(mcpx_runs_finished_total{job="mcpx"})') or 0.0
    async with connect(server, "alice") as client:
        for n in range(STATELESS_RUNS):
            answer = await client.call_tool("run_python", {"code": f"print({n})"})
            assert (answer.structured_content or {}).get("status") == "ok", answer
        sid = (await client.call_tool("new_session", {})).structured_content or {}
        for n in range(SESSION_RUNS):
            answer = await client.call_tool("run_python", {"code": f"x = {n}", "session_id": sid["session_id"]})
            assert (answer.structured_content or {}).get("status") == "ok", answer
    total = before + STATELESS_RUNS + SESSION_RUNS
    await wait_until(lambda: value_or_none(prometheus, 'sum(mcpx_runs_finished_total{job="mcpx"})') == total, 60)
    by_kind = {
        each["metric"]["kind"]: float(each["value"][1])
        for each in query(prometheus, 'sum by (kind) (mcpx_runs_finished_total{job="mcpx",status="ok"})')
    }
    assert by_kind["session"] >= SESSION_RUNS and by_kind["stateless"] >= STATELESS_RUNS
    assert value(prometheus, 'sum(mcpx_run_duration_seconds_count{job="mcpx"})') == total
    median = value(prometheus, 'histogram_quantile(0.5, sum by (le) (mcpx_run_duration_seconds_bucket{job="mcpx"}))')
    assert median is not None and median > 0
    assert value(prometheus, 'mcpx_sessions_open{job="mcpx"}') == 1

    def warm_pool_agrees() -> bool:
        health = httpx2.get(f"{server.url}/healthz", timeout=5).json()
        stored = value_or_none(prometheus, 'mcpx_pool_containers{job="mcpx",pool="stateless",state="warm"}')
        idle = int(health["idle"])
        return idle == 2 and stored == idle

    await wait_until(warm_pool_agrees, 60, every_s=0.5)


def value_or_none(prometheus: str, promql: str) -> float | None:
    try:
        return value(prometheus, promql)
    except httpx2.HTTPError:
        return None  # Prometheus is still starting


async def test_promtool_accepts_what_the_server_exposes(server: ServerProcess, tmp_path: Path) -> None:
    text = scraped(server)
    assert text.status_code == 200 and "mcpx_runs_started_total" in text.text
    with anyio.fail_after(30):
        checked = await anyio.run_process(["promtool", "check", "metrics"], input=text.content, check=False)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


async def test_metrics_refuse_an_identity_not_listed_as_a_reader(server: ServerProcess) -> None:
    assert scraped(server, "alice").status_code == 403
    missing = httpx2.get(f"{server.url}/metrics", timeout=10)
    assert missing.status_code == 401
    assert json.dumps(missing.text).count("mcpx_") == 0  # nothing of the metrics in the refusal
