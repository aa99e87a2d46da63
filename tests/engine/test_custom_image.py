"""A custom image with an extra package, built by the documented command and used by the server."""

from __future__ import annotations

from collections.abc import Iterator

import docker
import pytest
from _support import in_fresh_thread, make_test_config
from mcp import Client

from mcp_code_exec.commands.cli import main
from mcp_code_exec.config.settings import Config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
TAG = "mcp-code-exec-test-custom:latest"
# The packages changed, so the base image's preload bundle no longer matched: the build writes it again.
CODE = (
    "import toolz, humanize, mcpx_agent.zygote.bundle\nprint(list(toolz.unique([1, 1, 2])))\n"
    "print(humanize.naturalsize(1000))\nprint(mcpx_agent.zygote.bundle.LOADED > 500)"
)


@pytest.fixture(scope="module")
def custom_image(config: Config, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # python3-toolz comes from the machine's apt mirror; humanize is a wheel the host's pip fetches.
    requirements = tmp_path_factory.mktemp("custom") / "requirements.txt"
    requirements.write_text("# what the model asked for\nhumanize\n")
    command = ["image", "custom", "--tag", TAG, "--from", config.image, "--apt", "python3-toolz"]
    assert in_fresh_thread(main, [*command, "--requirements", str(requirements)]) == 0
    yield TAG
    client = docker.from_env()
    try:
        client.images.remove(TAG, force=True)
    finally:
        client.close()


async def test_code_imports_a_package_added_by_a_custom_image(custom_image: str) -> None:
    config = make_test_config(image=custom_image, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service, Client(build_server(service)) as client:
        result = await client.call_tool("run_python", {"code": CODE})
    assert result.structured_content is not None
    assert result.structured_content["status"] == "ok", result.structured_content
    assert result.structured_content["stdout"] == "[1, 2]\n1.0 kB\nTrue\n"
