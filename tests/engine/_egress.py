"""Plumbing of the egress tests: the proxy's image, a service with ``[egress]`` against the test
hosts of ``_egress_hosts``, and the code the tests run in sandboxes."""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import anyio
from _egress_hosts import EgressHosts, start, stop
from _support import in_fresh_thread, make_test_config

from mcp_code_exec.config.egress import EgressSettings
from mcp_code_exec.models import RunResult
from mcp_code_exec.service.facade import SandboxService

ALICE, BOB = "token:alice", "token:bob"  # alice may reach the host with the secret, bob may not
TOKEN_ENV = "MCPX_EGRESS_TEST_TOKEN"


def egress_image() -> str:
    """The proxy's image of this checkout: beside ``MCP_CODE_EXEC_TEST_IMAGE``'s tag, so two checkouts
    sharing an engine each test their own."""
    tag = os.environ.get("MCP_CODE_EXEC_TEST_IMAGE", "mcp-code-exec:latest").rpartition(":")[2]
    return os.environ.get("MCP_CODE_EXEC_TEST_EGRESS_IMAGE", f"mcp-code-exec-egress:{tag}")


def ensure_egress_image(image: str) -> None:
    """Build the proxy's image when it is missing or stale (as the sandbox image is)."""
    from mcp_code_exec.commands.egress_image import build_egress
    from mcp_code_exec.egress.image import image_status
    from mcp_code_exec.runtime.docker.engine import DockerEngine

    async def status() -> str:
        engine = await DockerEngine.connect()
        try:
            return await image_status(engine, image)
        finally:
            await engine.aclose()

    if in_fresh_thread(anyio.run, status) != "current":
        in_fresh_thread(anyio.run, lambda: build_egress(image))


def egress_settings(hosts: EgressHosts, state_dir: Path, **more: Any) -> dict[str, Any]:
    name = hosts.name
    return {
        "allow": [
            name("data"),
            {"host": name("api"), "principals": ["alice"]},
            name("pypi"),
            name("git"),
            "*.files." + "egress.test",
            name("internal"),  # resolves to the second host: a private address no range lists
            name("loop"),
            name("metadata"),
            f"{name('data')}:8443",
            f"{hosts.first}:9000",  # an address's own entry
        ],
        "private_ranges": [hosts.first_network],
        "upstream_ca": str(hosts.ca),
        "hosts_file": str(hosts.hosts_file),
        "state_dir": str(state_dir),
        "image": egress_image(),
        "budget_run_mb": 4,
        "secrets": [
            {"host": name("api"), "header": "Authorization", "value_env": TOKEN_ENV, "value_prefix": "Bearer "}
        ],
        **more,
    }


@contextmanager
def egress_test_hosts(secret: str, wheels: list[Path]) -> Iterator[EgressHosts]:
    """The egress image, and test hosts whose secret host checks ``secret`` (in the server's
    environment under ``TOKEN_ENV`` meanwhile), serving ``wheels`` on the test index."""
    ensure_egress_image(egress_image())
    made = start("Bearer " + secret, wheels)
    os.environ[TOKEN_ENV] = secret
    try:
        yield made
    finally:
        os.environ.pop(TOKEN_ENV, None)
        stop(made)


@asynccontextmanager
async def egress_service(
    hosts: EgressHosts, state_dir: Path, runtime: str | None, **config: Any
) -> AsyncIterator[SandboxService]:
    """A service with [egress] (its proxy answering) under ``runtime``."""
    egress = EgressSettings.model_validate(
        egress_settings(hosts, state_dir, **config.pop("egress", {})), context={"environ": dict(os.environ)}
    )
    settings = make_test_config(
        runtime=runtime,
        pool={"size": 1, "session_spares": 0},
        limits={"memory_mb": 512, "default_timeout_s": 60, "max_run_s": 600, **config.pop("limits", {})},
        **config,
    ).model_copy(update={"egress": egress})
    async with SandboxService.start(settings, identities={ALICE, BOB}) as service:
        outward = service.egress.egress
        assert outward is not None
        with anyio.fail_after(120):
            await outward.proxy.ready.wait()
        await service.wait_ready()
        yield service


# Code the tests run in sandboxes: a request and what came of it, as JSON on one line.
CLIENT = r"""
import json, os, socket, subprocess, sys, urllib.error, urllib.request
def get(url, headers=None, timeout=30):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=timeout) as r:
            return {"status": r.status, "body": r.read(100000).decode("latin-1")}
    except urllib.error.HTTPError as e:
        return {"status": e.code, "body": e.read(2000).decode("latin-1")}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"[:600]}
def tcp(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return {"connected": True}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
def udp(host, port):
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(2)
        s.sendto(b"ping", (host, port))
        return {"reply": s.recv(100).decode()}
    except OSError as e:
        return {"error": f"{type(e).__name__}: {e}"}
def sh(*args, timeout=120, **kw):
    done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, **kw)
    return {"rc": done.returncode, "out": done.stdout[-2000:], "err": done.stderr[-2000:]}
"""


async def run(
    service: SandboxService, owner: str, code: str, session_id: str | None = None, limit_s: float = 90
) -> RunResult:
    return await service.run(owner, CLIENT + code, session_id=session_id, timeout=limit_s)


def said(result: RunResult) -> Any:
    """The JSON the run printed last (the test's findings)."""
    assert result.status == "ok", (result.status, result.error, result.stderr[-2000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


@contextmanager
def proxy_output(service: SandboxService) -> Iterator[dict[str, str]]:
    """What the proxy's container writes on its stdout and its stderr while the block runs, as
    ``docker attach`` shows them (filled in at the block's end). Its engine keeps no log of it
    (``docker logs`` has nothing to read: its stdout carries its CA key at a first start)."""
    outward = service.egress.egress
    assert outward is not None and outward.proxy.container_id is not None
    captured: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="egress-proxy-output-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        with out.open("wb") as stdout, err.open("wb") as stderr:
            attach = ["docker", "attach", "--no-stdin", "--sig-proxy=false", outward.proxy.container_id]
            process = subprocess.Popen(attach, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr)
            try:
                yield captured
            finally:
                process.kill()  # the client of the attach, alone (it does not pass its signals on)
                process.wait(timeout=30)
        captured["stdout"] = out.read_text(errors="replace")
        captured["stderr"] = err.read_text(errors="replace")
