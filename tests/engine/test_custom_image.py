"""A custom image with an extra package, built by the documented command and used by the server."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest
from _support import in_fresh_thread, make_test_config
from mcp import Client

from mcp_code_exec.cli import main
from mcp_code_exec.config import Config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service import SandboxService

pytestmark = pytest.mark.anyio
TAG = "mcp-code-exec-test-custom:latest"


@pytest.fixture(scope="module")
def custom_image(config: Config) -> Iterator[str]:
    # python3-tabulate is a Debian package, reachable offline from the machine's apt mirror.
    assert (
        in_fresh_thread(main, ["image", "custom", "--tag", TAG, "--from", config.image, "--apt", "python3-tabulate"])
        == 0
    )
    yield TAG
    client = docker.from_env()
    try:
        client.images.remove(TAG, force=True)
    finally:
        client.close()


async def test_code_imports_a_package_added_by_a_custom_image(custom_image: str) -> None:
    config = make_test_config(image=custom_image, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service, Client(build_server(service)) as client:
        result = await client.call_tool("run_python", {"code": "import tabulate; print(tabulate.tabulate([[1, 2]]))"})
    assert result.structured_content is not None
    assert result.structured_content["status"] == "ok", result.structured_content
    assert "1  2" in result.structured_content["stdout"]
