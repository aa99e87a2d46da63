"""A session's history is written when the session goes idle, not after each run: whatever reads or
copies the session's state right after its runs still finds every one of them, in order (an export,
a fork, a pause)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import pytest
from _durable import OWNER, durable_service

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
async def service() -> AsyncIterator[SandboxService]:
    async with durable_service() as running:
        yield running


async def run_all(service: SandboxService, session_id: str, codes: list[str]) -> None:
    """The runs back to back, as an agent's loop sends them."""
    for code in codes:
        result = await service.run(OWNER, code, session_id=session_id)
        assert result.status == "ok", result


async def exported_code(service: SandboxService, session_id: str) -> list[str]:
    """The code of each cell of the session's notebook, exported now."""
    written = await service.export_notebook(OWNER, session_id, "history.ipynb")
    content = await service.read_file(OWNER, session_id, written.path)
    notebook = json.loads(content.data)
    return ["".join(cell["source"]) for cell in notebook["cells"] if cell["cell_type"] == "code"]


async def test_runs_back_to_back_are_all_in_an_export_and_in_a_fork_made_right_after_them(
    service: SandboxService,
) -> None:
    source = (await service.new_session(OWNER)).session_id
    forks: list[str] = []
    try:
        first = [f"n = {k}" for k in range(6)]
        await run_all(service, source, first)
        assert await exported_code(service, source) == first
        second = ["n += 1", "m = n * 2"]
        await run_all(service, source, second)
        forks = await service.fork_session(OWNER, source)
        assert await exported_code(service, forks[0]) == first + second
    finally:
        for session_id in [source, *forks]:
            await service.close_session(OWNER, session_id)


async def test_a_session_paused_right_after_a_run_keeps_that_run_in_its_history(service: SandboxService) -> None:
    session_id = (await service.new_session(OWNER)).session_id
    try:
        await run_all(service, session_id, ["a = 1", "a += 1"])
        assert await service.keeper.pause(service.sessions.get(session_id, OWNER))
        assert await exported_code(service, session_id) == ["a = 1", "a += 1"]
    finally:
        await service.close_session(OWNER, session_id)
