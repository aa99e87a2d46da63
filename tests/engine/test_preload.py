"""The zygote takes the modules it preloads from the image's bundle, one file, rather than opening
some 2,000 (see ``mcpx_agent.zygote.bundle``); workers inherit the count of modules it took."""

from __future__ import annotations

import pytest

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "preload"
PROBE = (
    "import mcpx_agent.zygote.bundle, pandas\n(mcpx_agent.zygote.bundle.LOADED > 500, type(pandas.__loader__).__name__)"
)


async def test_stateless_and_session_containers_load_the_libraries_from_the_bundle(service: SandboxService) -> None:
    stateless = await service.run(OWNER, PROBE)
    assert stateless.result == "(True, 'SourceFileLoader')", stateless
    sid = (await service.new_session(OWNER)).session_id
    try:
        session = await service.run(OWNER, PROBE, session_id=sid)
        assert session.result == "(True, 'SourceFileLoader')", session
    finally:
        await service.close_session(OWNER, sid)
