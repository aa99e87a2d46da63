"""Pool modes and the pool's relation to MCP connections."""

from __future__ import annotations

import anyio
import pytest
from _support import make_test_config
from mcp import Client

from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
HOSTNAME = "import socket; socket.gethostname()"


async def test_recycled_mode_reuses_warm_containers() -> None:
    config = make_test_config(pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(config) as service:
        names = {(await service.run("m", HOSTNAME)).result for _ in range(3)}
    assert len(names) == 1


async def test_single_use_mode_gives_every_run_a_new_container() -> None:
    config = make_test_config(pool={"size": 2, "session_spares": 0, "mode": "single-use"})
    async with SandboxService.start(config) as service:
        names = [(await service.run("m", HOSTNAME)).result for _ in range(4)]
    assert len(set(names)) == 4


async def test_connections_share_one_pool_however_often_the_lifespan_runs(service: SandboxService) -> None:
    server = build_server(service)
    pool = service.stateless_pool
    # Every container the pool wants is started and idle: its warm-up's starts are not the runs'.
    await pool.wait_for(lambda pool: pool.idle >= pool.size and pool.busy == 0, timeout_s=120)
    starts = pool.starts
    for _ in range(3):  # in memory (like SSE) the SDK enters the lifespan once per connection
        async with Client(server) as client:
            result = await client.call_tool("run_python", {"code": "print('hi')"})
            assert not result.is_error
    assert pool.starts == starts


async def test_a_busy_pool_returns_a_tool_error_that_says_retry() -> None:
    config = make_test_config(pool={"size": 1, "max_size": 1, "session_spares": 0, "acquire_timeout_s": 1})
    async with SandboxService.start(config) as service:
        await service.wait_ready()
        async with Client(build_server(service)) as client:
            started = anyio.Event()

            async def occupy() -> None:
                started.set()
                await client.call_tool("run_python", {"code": "import time; time.sleep(4)"})

            async with anyio.create_task_group() as tg:
                tg.start_soon(occupy)
                await started.wait()
                await anyio.wait_all_tasks_blocked()
                with anyio.fail_after(10):
                    busy = await client.call_tool("run_python", {"code": "1"})
                assert busy.is_error
                text = busy.content[0].text  # type: ignore[union-attr]
                assert "busy" in text and "retry" in text
