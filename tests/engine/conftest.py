"""The real-engine tier: every behaviour against a real Docker engine and the real image.

The image is built first if it is missing or stale. Tests marked ``engine_restart`` stop and
start the engine under everyone else, so they run last, whatever their file is called.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from _extra_engines import ExtraEngine, start_extra_engines, stop_extra_engines
from _local_service import private_runtime_dir, stop_services
from _support import (
    ensure_image,
    existing_volumes,
    make_test_config,
    project_containers,
    project_volumes,
    session_records,
)
from mcp import Client

from mcp_code_exec.config.settings import Config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.get_closest_marker("engine_restart") is not None)  # stable: others keep order


@pytest.fixture(scope="session", autouse=True)
def config() -> Config:
    """The test configuration; also builds the image once if it is missing or stale."""
    cfg = make_test_config()
    ensure_image(cfg)
    return cfg


@pytest.fixture(autouse=True)
def private_local_services(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every test has a runtime directory of its own (``MCP_CODE_EXEC_RUNTIME_DIR``): a stdio front it starts
    reaches a local service of that test alone, never a user's, and the test ends by stopping it."""
    runtime_dir = private_runtime_dir()
    monkeypatch.setenv("MCP_CODE_EXEC_RUNTIME_DIR", str(runtime_dir))
    try:
        yield
    finally:
        killed = stop_services(runtime_dir)
        shutil.rmtree(runtime_dir, ignore_errors=True)
        assert killed == [], f"local services that did not stop on SIGTERM: {killed}"


@pytest.fixture(scope="session")
async def service(config: Config) -> AsyncIterator[SandboxService]:
    records_before = session_records()
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc
    # The suite's own leak check: the shared service outlives every test, including the one that
    # restarts the engine under it, and must still leave nothing behind; nor may any server a test
    # started leave a durable session behind (a server process keeps them unless told otherwise).
    assert project_containers(instance=svc.instance) == []
    assert project_volumes(instance=svc.instance) == []
    assert existing_volumes(svc.volumes.names) == []
    assert session_records() - records_before == set()


@pytest.fixture(scope="session")
def extra_engines(config: Config) -> Iterator[list[ExtraEngine]]:
    """Two more Docker engines on this machine, each a dockerd of its own with the sandbox image
    (see ``_extra_engines``); stopped, and their data removed, at the end of the session."""
    if os.geteuid() != 0:
        pytest.skip("needs root: starts two extra dockerd daemons (own sockets, data roots, bridges)")
    if shutil.which("dockerd") is None or shutil.which("ip") is None:
        pytest.skip("needs a local dockerd and iproute2 (ip) to start extra engines")
    began = time.monotonic()
    engines, load_s = start_extra_engines(2, config.image)
    logging.getLogger(__name__).warning(
        "two extra engines up in %.1f s, of which %.1f s loading the image", time.monotonic() - began, load_s
    )
    try:
        yield engines
    finally:
        stop_extra_engines(engines)


@pytest.fixture(params=["auto", "legacy"])
def mode(request: pytest.FixtureRequest) -> str:
    """The protocol era a client speaks: the 2026 stateless one (``auto``) or the 2025 sessions."""
    return str(request.param)


@pytest.fixture
async def client(service: SandboxService, mode: str) -> AsyncIterator[Client]:
    """An in-memory MCP client of the shared service, in each protocol era."""
    async with Client(build_server(service), mode=mode) as c:
        yield c
