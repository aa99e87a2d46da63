"""A session's variables outlive its container: a DataFrame survives ``docker kill`` of the session's
container, a pause, and a fork (the server's restart: test_durable_restart.py).

They need the image's agent to keep snapshots (to answer Restore); with an agent that predates them
("unknown op") they are skipped, and they run by themselves once the image has it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _durable import OWNER, agent_restores, docker, durable_service
from _support import wait_until

from mcp_code_exec.mcp_server.answers import render_run
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
MAKE = """
import pandas as pd
df = pd.DataFrame({'x': range(1000), 'y': [i * i for i in range(1000)]})
gen = (i for i in range(3))
"""
SHOW = "print(df.shape, int(df.y.sum()))"
SHOWN = "(1000, 2) 332833500\n"


@pytest.fixture(scope="module")
async def service() -> AsyncIterator[SandboxService]:
    async with durable_service() as running:
        if await agent_restores(running):
            yield running
            return
    # Skipped once the service is gone (a skip raised inside it would come out of its task group)
    pytest.skip("the image's agent predates snapshots (it answers Restore with 'unknown op')")


async def session_with_df(service: SandboxService) -> str:
    session_id = (await service.new_session(OWNER)).session_id
    result = await service.run(OWNER, MAKE, session_id=session_id)
    assert result.status == "ok", result
    return session_id


async def test_a_dataframe_survives_a_kill_of_its_sessions_container_and_what_cannot_be_kept_is_named(
    service: SandboxService,
) -> None:
    session_id = await session_with_df(service)
    try:
        sandbox = service.sessions.get(session_id, OWNER).sandbox
        assert sandbox is not None
        await service.keeper.snapshot_sync(sandbox)  # idle long enough for its snapshot to be written
        docker("kill", sandbox.container_id)
        await wait_until(lambda: not sandbox.alive, 30)  # between runs: the service has seen it die
        result = await service.run(OWNER, SHOW, session_id=session_id)
        assert result.status == "ok" and result.stdout == SHOWN, result
        assert any("not kept" in note and "gen" in note for note in result.notes), result.notes
        assert result.session_restarted and "variables were restored from its last snapshot" in render_run(result)
    finally:
        await service.close_session(OWNER, session_id)


async def test_a_dataframe_survives_a_pause(service: SandboxService) -> None:
    session_id = await session_with_df(service)
    try:
        assert await service.keeper.pause(service.sessions.get(session_id, OWNER))
        result = await service.run(OWNER, SHOW, session_id=session_id)
        assert result.status == "ok" and result.stdout == SHOWN, result
        assert any("resumed in" in note for note in result.notes), result.notes
    finally:
        await service.close_session(OWNER, session_id)


async def test_a_snapshot_that_cannot_be_loaded_at_resume_is_reported_as_a_restart_with_its_variables_lost(
    service: SandboxService,
) -> None:
    session_id = (await service.new_session(OWNER)).session_id
    bomb = "import os\nclass Bomb:\n    def __reduce__(self):\n        return (os._exit, (3,))\nbomb = Bomb()\nkept = 7"
    try:
        assert (await service.run(OWNER, bomb, session_id=session_id)).status == "ok"
        assert await service.keeper.pause(service.sessions.get(session_id, OWNER))  # its snapshot is complete
        result = await service.run(OWNER, "'kept' in globals()", session_id=session_id)
        assert result.status == "ok" and result.result == "False", result
        assert result.session_restarted, result
        assert any("could not be loaded" in note for note in result.notes), result.notes
        assert "its snapshot could not be loaded" in render_run(result), render_run(result)
    finally:
        await service.close_session(OWNER, session_id)


async def test_a_fork_starts_with_the_sources_dataframe_and_goes_its_own_way(service: SandboxService) -> None:
    parent = await session_with_df(service)
    (fork,) = await service.fork_session(OWNER, parent)
    try:
        forked = await service.run(OWNER, f"{SHOW}\ndf = df.head(10)", session_id=fork)
        assert forked.status == "ok" and forked.stdout == SHOWN, forked
        assert (await service.run(OWNER, SHOW, session_id=parent)).stdout == SHOWN
        assert (await service.run(OWNER, "print(len(df))", session_id=fork)).stdout == "10\n"
    finally:
        await service.close_session(OWNER, fork)
        await service.close_session(OWNER, parent)
