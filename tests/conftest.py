from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from mcp_code_exec.config import Config
from mcp_code_exec.service import SandboxService
from mcp_code_exec.testing import ensure_image, make_test_config


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session", autouse=True)
def config() -> Config:
    """The test configuration; also builds the image once if it is missing or stale."""
    cfg = make_test_config()
    ensure_image(cfg)
    return cfg


@pytest.fixture(scope="session")
async def service(config: Config) -> AsyncIterator[SandboxService]:
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc
